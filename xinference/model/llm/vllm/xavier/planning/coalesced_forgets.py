"""The scheduler's ``forget`` calls, one out at a time.

While the block directory lists a replica's vLLM cache (the launch spans hosts: no local
publication), every step in which vLLM hands out published blocks sends the directory a
``forget`` of them, from vLLM's scheduling loop, without waiting for it.  At 64 replicas
those calls alone keep the directory's one actor busy: a call costs its process 0.2-0.3 ms
before any work (``benchmarks/directory_call_bench.py``).  :class:`CoalescedForgets` keeps
one call out at a time; what the steps forget meanwhile goes in the next call, made when
the last is answered.  An idle directory is called as each step forgets; a busy one gets
fewer, larger calls.  A failed call is logged: its entries stay until their readers'
checks fail them (a miss, never wrong KV), as before.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .log_names import package_logger

logger = package_logger(__name__)

#: ``group -> [(slot, generation now)]`` of blocks vLLM handed out
Forgotten = Dict[int, List[Tuple[int, int]]]
#: starts ``forget(forgotten)`` on the directory and returns its future, which completes
#: (answered, failed or timed out) within :data:`CALL_TIMEOUT_S`
SendForget = Callable[[Forgotten], "concurrent.futures.Future[Any]"]
#: the longest one forget call may stay out (the next waits for it)
CALL_TIMEOUT_S = 30.0


class CoalescedForgets:
    """One forget call out at a time (module docstring); thread-safe."""

    def __init__(self, send: SendForget) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._pending: Forgotten = {}
        self._out = False
        self._idle = threading.Condition(self._lock)
        self.calls = 0  # directory calls made
        self.coalesced = 0  # steps' forgets that went in a call with an earlier step's

    def add(self, forgotten: Mapping[int, Sequence[Tuple[int, int]]]) -> None:
        """Forget these blocks: now, or with the next call if one is out."""
        with self._lock:
            if self._out and self._pending:
                self.coalesced += 1
            for group, pairs in forgotten.items():
                self._pending.setdefault(int(group), []).extend(pairs)
            if self._out:
                return
            batch = self._take()
        self._start(batch)

    def _take(self) -> Forgotten:
        batch, self._pending = self._pending, {}
        self._out = bool(batch)
        return batch

    def _start(self, batch: Forgotten) -> None:
        if not batch:
            return
        self.calls += 1
        try:
            fut: Optional[concurrent.futures.Future[Any]] = self._send(batch)
        except Exception as exc:
            self._answered(batch, exc)
            return
        assert fut is not None
        fut.add_done_callback(lambda f: self._answered(
            batch, None if f.cancelled() else f.exception()))

    def _answered(self, batch: Forgotten, exc: Optional[BaseException]) -> None:
        if exc is not None:
            logger.warning("xavier: forgetting %d reused in-place blocks failed: %r",
                           sum(len(p) for p in batch.values()), exc)
        with self._lock:
            following = self._take()
            if not following:
                self._idle.notify_all()
        self._start(following)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until no call is out and none waits (tests)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._out and not self._pending, timeout)
