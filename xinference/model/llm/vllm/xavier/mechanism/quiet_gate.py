"""Background work held back while a hit is on its way to its first forward (issue #34).

A cross-replica hit at C1 waits through three of vLLM's steps between the step that
launches its load and its own forward.  The victim saves of the loading step wake the
worker's background threads right then: the room thread demotes and claims (a directory
call), the publisher registers the saves (another); both run Python in the engine's
process, in the window the hit waits through, and took the GIL from vLLM's step thread
there (session 31: a load launch of 8.6 ms wall for 3.1 ms CPU; session 36: a hit's wait
20.3 ms with saves, 9.6 ms without).

:class:`QuietGate` lets that work wait until the worker has launched no load and no save
for ``quiet_s``, at most ``max_defer_s`` a wait, so that it lands after the hit's forward
instead of inside its wait.  Nothing depends on it for correctness: it only moves when
the background threads run.  Work that cannot wait (the top tier short of free slots,
:meth:`QuietGate.wait`'s ``urgent``; a flush, :meth:`QuietGate.hurried`; close) goes at
once.  A waiter with other work (the publisher: a host-index write queued behind the
deferred directory call) is let out by :meth:`QuietGate.poke` and waits again under the
same deadline.  ``quiet_s`` 0 turns it off (``xavier_quiet_ms`` / ``XAVIER_QUIET_MS``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional, Tuple

from ..planning.counters import CounterSink

#: a wait's longest deferral, in quiet spells (the worker's gate: ``max_defer_s``)
MAX_DEFER_QUIETS = 4


def _never() -> bool:
    return False


class QuietGate:
    """See the module docstring.  ``sink`` counts ``background_deferrals`` (waits that
    held work back, each) and ``background_deferred_us`` (their time)."""

    def __init__(self, quiet_s: float, max_defer_s: Optional[float] = None, *,
                 sink: CounterSink, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s, self.max_defer_s = self._timing(quiet_s, max_defer_s)
        #: the gate's clock (a waiter's ``since`` is read from it)
        self.clock = clock
        self._sink = sink
        self._cond = threading.Condition()
        self._busy_at = float("-inf")
        self._hurry = 0
        self._closed = False

    def set(self, quiet_s: float, max_defer_s: Optional[float] = None) -> None:
        """Change the timing without a restart (``XavierEngine.set_quiet_ms``: both timings
        compared on the same warm engines); waiters re-check at once (0 lets them go)."""
        timing = self._timing(quiet_s, max_defer_s)
        with self._cond:
            self.quiet_s, self.max_defer_s = timing
            self._cond.notify_all()

    @staticmethod
    def _timing(quiet_s: float, max_defer_s: Optional[float]) -> Tuple[float, float]:
        """(quiet_s, max_defer_s); the latter :data:`MAX_DEFER_QUIETS` quiet spells by
        default."""
        max_defer_s = MAX_DEFER_QUIETS * quiet_s if max_defer_s is None else max_defer_s
        if quiet_s < 0 or max_defer_s < 0:
            raise ValueError(f"quiet_s / max_defer_s: expected >= 0, got {quiet_s} / "
                             f"{max_defer_s}")
        return quiet_s, max_defer_s

    def busy(self) -> None:
        """The worker launched a load or a save now (vLLM's step thread; never waits)."""
        self._busy_at = self.clock()  # (a float store: atomic under the GIL)

    def wait(self, urgent: Callable[[], bool] = lambda: False,
             interrupt: Callable[[], bool] = _never,
             since: Optional[float] = None) -> bool:
        """Block the calling background thread until its work may go: the worker has been
        quiet for ``quiet_s``, ``max_defer_s`` passed ``since`` (default: now; the clock's
        time the work was first held back), ``urgent()`` is true, a flush hurries or the
        gate closed -- True; or until ``interrupt()`` is true first (re-checked when
        :meth:`poke` d) -- False: the caller does other work and waits again."""
        if self.quiet_s <= 0:
            return True
        start = self.clock()
        since = start if since is None else since
        go, held = True, False
        with self._cond:
            while not self._closed and not self._hurry:
                now = self.clock()
                quiet_at, deadline = self._busy_at + self.quiet_s, since + self.max_defer_s
                if now >= quiet_at or now >= deadline or urgent():
                    break
                if interrupt():
                    go = False
                    break
                held = True
                # (re-checked at least every quiet_s / 4 -- urgent() may turn true -- and
                # every 2 ms for an interrupt nothing pokes, e.g. an event completing)
                step = self.quiet_s / 4 if interrupt is _never else min(self.quiet_s / 4, 0.002)
                self._cond.wait(min(quiet_at, deadline, now + step) - now)
        if held:  # (a wait that held its work back, whatever ended it)
            self._sink.add("background_deferrals")
            self._sink.add("background_deferred_us", int(1e6 * (self.clock() - start)))
        return go

    def poke(self) -> None:
        """Make the waiters check their ``interrupt`` now (never waits for them)."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def hurried(self) -> Iterator[None]:
        """While inside, nothing waits (a flush wants the background work done now)."""
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._hurry -= 1

    def close(self) -> None:
        """Release every waiter, for good (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
