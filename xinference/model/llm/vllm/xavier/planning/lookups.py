"""Batched, asynchronous block-directory lookups for the scheduler (no vLLM, no xoscar).

vLLM asks the connector about each waiting request inside ``schedule()``; a directory
round trip per request would hold the engine's scheduling loop once per new request.  So
requests are asked for when they arrive (``on_new_request``) and the lookups queued since
the last call go to the directory together, in ONE call (``send``), without waiting.
:meth:`DirectoryLookups.take` gives the answer when it is there, waits for it at most a
bounded time (once per step: :meth:`DirectoryLookups.new_step` refills the budget), and
otherwise says "pending": the connector then answers vLLM ``None`` (ask again next step).
A lookup older than ``give_up_s`` is given up (the request proceeds as a miss; leases of a
late answer are released when it arrives).  A failed call is a miss, never an error.

Every answer carries leases (taken by the directory); whatever is not handed on to a load
is released here: answers that are dropped, replaced or arrive after their request went.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .block_directory import QueryResult
from .log_names import package_logger

logger = package_logger(__name__)

#: one call for many lookups: ``[(request_id, keys), ...]`` -> a future of one
#: :class:`QueryResult` per lookup, in order
SendFn = Callable[[Sequence[Tuple[str, Sequence[int]]]],
                  "concurrent.futures.Future[List[QueryResult]]"]


class State(enum.Enum):
    """Where a request's lookup stands."""
    NONE = "none"  # never asked (or dropped)
    PENDING = "pending"
    DONE = "done"
    MISS = "miss"  # failed or given up: proceed without a hit


@dataclass
class Lookup:
    """One request's lookup in flight or answered."""
    start: int  # first block asked for
    keys: Tuple[int, ...]
    asked_at: float
    result: Optional[QueryResult] = None
    failed: bool = False
    answered_at: Optional[float] = None  # when the directory's answer arrived


class DirectoryLookups:
    """Batched directory lookups of the scheduler: all requests that arrived since the last
    send go in ONE ``query_many``; a step waits for answers at most ``wait_budget_s``; a
    lookup unanswered after ``give_up_s`` is a miss.  An answer holds no lease (the
    scheduler half leases what a step loads)."""
    def __init__(self, send: SendFn, wait_budget_s: float = 0.01,
                 give_up_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._wait_budget_s = wait_budget_s
        self._give_up_s = give_up_s
        self._clock = clock
        self._lock = threading.Condition()
        self._lookups: Dict[str, Lookup] = {}
        self._queued: List[str] = []
        self._budget = wait_budget_s
        #: figures since the last :meth:`take_stats`
        self.calls = 0
        self.deferred = 0
        self.given_up = 0
        self.wait_us = 0

    # ----------------------------------------------------------------- asking
    def ask(self, request_id: str, start: int, keys: Sequence[int]) -> None:
        """Queue a lookup of ``keys`` (the request's blocks from ``start``); replaces an
        earlier lookup of the request."""
        self.drop(request_id)
        with self._lock:
            self._lookups[request_id] = Lookup(start, tuple(int(k) for k in keys),
                                               self._clock())
            self._queued.append(request_id)

    def flush(self) -> None:
        """Send every queued lookup in one call (does not wait for the answer)."""
        with self._lock:
            batch = [(rid, self._lookups[rid]) for rid in self._queued if rid in self._lookups]
            self._queued = []
        if not batch:
            return
        self.calls += 1
        try:
            fut = self._send([(rid, lk.keys) for rid, lk in batch])
        except Exception as exc:
            self._settle(batch, None, exc)
            return
        fut.add_done_callback(lambda f: self._done(batch, f))

    def _done(self, batch: List[Tuple[str, Lookup]],
              fut: concurrent.futures.Future[List[QueryResult]]) -> None:
        try:
            results: Optional[List[QueryResult]] = fut.result()
            error: Optional[BaseException] = None
        except BaseException as exc:
            results, error = None, exc
        self._settle(batch, results, error)

    def _settle(self, batch: List[Tuple[str, Lookup]], results: Optional[List[QueryResult]],
                error: Optional[BaseException]) -> None:
        if error is not None:
            logger.warning("xavier: directory lookup of %d requests failed (%r); treating "
                           "them as misses", len(batch), error)
        with self._lock:
            for i, (rid, lk) in enumerate(batch):
                res = results[i] if results is not None and i < len(results) else None
                if self._lookups.get(rid) is not lk:  # dropped or replaced meanwhile
                    continue
                lk.result, lk.failed, lk.answered_at = res, res is None, self._clock()
            self._lock.notify_all()

    # ----------------------------------------------------------------- taking
    def new_step(self) -> None:
        """A new scheduler step: the wait budget is full again."""
        self._budget = self._wait_budget_s

    def take(self, request_id: str) -> Tuple[State, Optional[Lookup]]:
        """The lookup of ``request_id``: ``DONE`` with its answer, ``PENDING`` (ask again
        later), ``MISS`` (proceed without a hit) or ``NONE`` (never asked).  Sends queued
        lookups first; may wait within the step's budget."""
        with self._lock:
            queued = request_id in self._queued
        if queued:
            self.flush()
        with self._lock:
            lk = self._lookups.get(request_id)
            if lk is None:
                return State.NONE, None
            if lk.result is None and not lk.failed and self._budget > 0:
                t0 = self._clock()
                self._lock.wait_for(lambda: lk.result is not None or lk.failed,
                                    timeout=self._budget)
                spent = self._clock() - t0
                self._budget -= spent
                self.wait_us += int(1e6 * spent)
            if lk.result is not None or lk.failed:
                del self._lookups[request_id]
                if lk.failed:
                    return State.MISS, None
                return State.DONE, lk
            if self._clock() - lk.asked_at > self._give_up_s:
                del self._lookups[request_id]  # a late answer is dropped in _settle
                self.given_up += 1
                logger.warning("xavier: directory lookup of %s took over %.0f ms; treating it "
                               "as a miss", request_id, 1000 * self._give_up_s)
                return State.MISS, None
            self.deferred += 1
            return State.PENDING, None

    def answered(self, request_id: str) -> bool:
        """Whether the lookup of ``request_id`` was answered (or failed) and not yet taken."""
        with self._lock:
            lk = self._lookups.get(request_id)
            return lk is not None and (lk.result is not None or lk.failed)

    def drop(self, request_id: str) -> None:
        """Forget the lookup of ``request_id`` (a late answer is dropped on arrival)."""
        with self._lock:
            self._lookups.pop(request_id, None)

    def close(self) -> None:
        """Forget every lookup (engine shutdown)."""
        with self._lock:
            self._lookups.clear()
            self._queued = []

    def take_stats(self) -> Dict[str, int]:
        out = {"lookup_calls": self.calls, "lookups_deferred": self.deferred,
               "lookups_given_up": self.given_up, "lookup_wait_us": self.wait_us}
        self.calls = self.deferred = self.given_up = self.wait_us = 0
        return out

    @property
    def outstanding(self) -> int:
        """Lookups asked and not yet taken or dropped."""
        with self._lock:
            return len(self._lookups)
