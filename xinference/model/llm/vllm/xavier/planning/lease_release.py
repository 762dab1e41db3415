"""Coalesced lease releases: one directory call for the releases of many threads' moments.

A step of 512 loaded blocks holds up to 512 leases; the scheduler half releases a load's
when vLLM reports it done, from vLLM's scheduling loop or, for a lease granted after that
report, from the bridge's thread.  :class:`BatchingReleaser` turns
the releases asked between two runs of the bridge's event loop into ONE
``release(ids)`` call to the block directory; nobody waits for it (a late release only
delays an eviction).  A call that fails (the directory restarting, say) is tried again a
few times with growing pauses: a release the directory does not know is harmless, a
lost one would keep a slot from ever being reused.  :meth:`BatchingReleaser.flush` waits
for every call so far (tests, shutdown).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, List, Optional, Sequence

from .load_batch import NO_LEASE
from .log_names import package_logger

logger = package_logger(__name__)

#: starts ``release(ids)`` on the directory and returns its future (or None: no directory)
SendRelease = Callable[[Sequence[int]], Optional["concurrent.futures.Future[Any]"]]
#: runs a callback soon on another thread (the bridge's loop)
Schedule = Callable[[Callable[[], None]], None]
#: pauses before the retries of a failed release call (seconds)
RETRY_PAUSES_S = (0.2, 1.0, 3.0, 10.0)


class BatchingReleaser:
    """Coalesces lease releases into one directory call per moment (scheduled on the
    bridge's loop); a failed send is retried, never dropped."""
    def __init__(self, send: SendRelease, schedule: Schedule) -> None:
        self._send = send
        self._schedule = schedule
        self._lock = threading.Lock()
        self._ids: List[int] = []
        self._scheduled = False
        self._inflight: List[concurrent.futures.Future[Any]] = []
        self.calls = 0  # directory calls made
        self.failures = 0

    def release(self, lease_id: int) -> None:
        self.release_many((lease_id,))

    def release_many(self, lease_ids: Sequence[int]) -> None:
        """Queue ``lease_ids`` for the next call (:data:`~.load_batch.NO_LEASE`, a location
        that needed none, is dropped here)."""
        ids = [int(x) for x in lease_ids if int(x) != NO_LEASE]
        if not ids:
            return
        with self._lock:
            self._ids.extend(ids)
            if self._scheduled:
                return
            self._scheduled = True
        self._schedule(self._flush)

    def _flush(self) -> None:
        with self._lock:
            ids, self._ids, self._scheduled = self._ids, [], False
        if ids:
            self._send_batch(ids, 0)

    def _send_batch(self, ids: List[int], attempt: int) -> None:
        self.calls += 1
        try:
            fut = self._send(ids)
        except Exception as exc:
            self._failed(ids, attempt, exc)
            return
        if fut is None:
            self._failed(ids, attempt, ConnectionError("no block directory"))
            return
        with self._lock:
            self._inflight = [f for f in self._inflight if not f.done()] + [fut]

        def done(f: concurrent.futures.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is not None:
                self._failed(ids, attempt, f.exception())

        fut.add_done_callback(done)

    def _failed(self, ids: List[int], attempt: int, exc: Optional[BaseException]) -> None:
        self.failures += 1
        if attempt < len(RETRY_PAUSES_S):
            pause = RETRY_PAUSES_S[attempt]
            logger.info("xavier: releasing %d leases failed (%r); again in %.1f s", len(ids),
                        exc, pause)
            timer = threading.Timer(pause, lambda: self._schedule(
                lambda: self._send_batch(ids, attempt + 1)))
            timer.daemon = True
            timer.start()
            return
        logger.warning("xavier: releasing %d leases failed %d times (%r); the directory keeps "
                       "them until the holder's rank is purged", len(ids), attempt + 1, exc)

    def flush(self, timeout: float = 10.0) -> bool:
        """Send what is buffered now and wait for every release call so far; whether they
        all completed within ``timeout``."""
        self._flush()
        with self._lock:
            pending = list(self._inflight)
        return not concurrent.futures.wait(pending, timeout=timeout).not_done


def directory_sender(directory: Any, start: Callable[[Callable[[], Awaitable[Any]]],
                                                    concurrent.futures.Future[Any]]
                     ) -> SendRelease:
    """A :data:`SendRelease` calling ``release(ids)`` of the directory actor that
    ``directory`` (an unchecked :class:`~..vllm_side.actor_bridge.LazyActor`: its ref needs
    no lookup, so this is safe on the bridge's own thread) names, started with ``start``
    (``ActorBridge.start``)."""
    if getattr(directory, "checked", False):
        raise ValueError("directory: an unchecked LazyActor (checked=False) is needed here")

    async def release(ids: List[int]) -> Any:
        ref = directory.get()
        try:
            return await ref.release(ids)
        except Exception:
            directory.forget()  # looked up again next time (a restarted directory)
            raise

    def send(ids: Sequence[int]) -> concurrent.futures.Future[Any]:
        return start(lambda: release(list(ids)))

    return send
