"""Calling xoscar actors from vLLM's synchronous engine-core and worker code.

vLLM's connector methods are synchronous and run outside any event loop that
xoscar owns.  :class:`ActorBridge` runs one asyncio loop in a daemon thread
per process and submits coroutines to it:

* :meth:`ActorBridge.call` blocks the caller until the coroutine finishes
  (or ``timeout`` passes: then the coroutine is cancelled and ``TimeoutError``
  raised);
* :meth:`ActorBridge.submit` does not wait (used for lease releases);
* :class:`LazyActor` resolves an actor ref on first use and at most once per
  ``retry_seconds`` while the actor does not exist yet (vLLM V1 starts the
  engine before Xinference creates the transfer actor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

from ..planning.log_names import package_logger
from ..planning.trace_spans import span

logger = package_logger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_bridge: Optional[ActorBridge] = None


class ActorBridge:
    """One event loop on a thread of its own, through which vLLM's threads call xoscar
    actors (blocking with a timeout, or as futures) without touching vLLM's loops."""
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="xavier-actor-bridge", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> ActorBridge:
        """The process's bridge (created on first use)."""
        global _bridge
        with _lock:
            if _bridge is None or not _bridge._thread.is_alive():
                _bridge = cls()
            return _bridge

    def call(self, make: Callable[[], Awaitable[T]], timeout: Optional[float] = 60.0) -> T:
        return wait_for_call(self.start(make), timeout)

    def start(self, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Start an actor call and return at once; the caller waits on the future later."""
        return asyncio.run_coroutine_threadsafe(_wrap(make), self._loop)

    def schedule(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` soon on the bridge's thread (coalescing: everything asked before it
        runs can be handled by it)."""
        self._loop.call_soon_threadsafe(fn)

    def submit(self, make: Callable[[], Awaitable[Any]], what: str) -> None:
        def done(f: concurrent.futures.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is not None:
                logger.warning("xavier: %s failed: %s", what, f.exception())

        asyncio.run_coroutine_threadsafe(_wrap(make), self._loop).add_done_callback(done)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


#: the rank the bridge's spans carry (the bridge serves every rank of its process)
BRIDGE_RANK = -1


async def _wrap(make: Callable[[], Awaitable[T]]) -> T:
    # a span per actor call (``XAVIER_STEP_TRACE`` only): its wall includes the answer's
    # wait, its CPU the bridge thread's whole work meanwhile (xoscar's serialization, I/O)
    with span(BRIDGE_RANK, "bridge"):
        return await make()


class LazyActor:
    """An actor ref found on first use; ``None`` while the actor does not exist.

    ``checked=False``: an actor that is meant to be there (the block directory): the ref is
    made without asking the pool, so a call fails fast while the actor is gone and reaches
    it again as soon as it is back at its address (a restarted directory), with no lookup
    to wait for or retry."""

    def __init__(self, bridge: ActorBridge, address: str, uid: str,
                 retry_seconds: float = 1.0, checked: bool = True) -> None:
        self.bridge, self.address, self.uid = bridge, address, uid
        self.retry_seconds = retry_seconds
        self.checked = checked
        self._ref: Any = None
        self._next_try = 0.0

    def _unchecked(self) -> Any:
        import xoscar as xo

        if self._ref is None:
            self._ref = xo.create_actor_ref(self.address, self.uid)
        return self._ref

    def get(self, timeout: float = 10.0) -> Any:
        if not self.checked:
            return self._unchecked()
        if self._ref is not None:
            return self._ref
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_seconds
        try:
            import xoscar as xo

            self._ref = self.bridge.call(lambda: xo.actor_ref(self.address, self.uid),
                                         timeout=timeout)
            logger.info("xavier: found actor %s at %s", self.uid, self.address)
        except Exception as exc:
            logger.debug("xavier: actor %s at %s not there yet: %s", self.uid, self.address, exc)
            self._ref = None
        return self._ref

    def forget(self) -> None:
        """Drop the ref (its actor went away); the next ``get`` looks it up again."""
        if not self.checked:
            return  # the same address and uid reach the actor when it is back
        self._ref = None
        self._next_try = 0.0


def wait_for_call(fut: concurrent.futures.Future[T], timeout: Optional[float]) -> T:
    """The answer of a call :meth:`ActorBridge.start` started, within ``timeout`` s: past
    it the call is cancelled and :class:`TimeoutError` raised."""
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise TimeoutError(f"actor call did not finish within {timeout} s") from None
