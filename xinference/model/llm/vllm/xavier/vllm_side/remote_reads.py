"""Reads of another host's blocks for one worker: through the rank's transfer actor, into
staging rows this process maps too; and the peers those reads keep out for a while.

A read from a peer whose host went dark runs to the call's timeout on the worker's
completion thread (every later load's completion waits behind it), so a read that failed
for want of the peer (no answer in time, a refused or broken connection) keeps that peer's
rows out of loads for :data:`FETCH_RETRY_S`, doubling with each such failure in a row up
to :data:`FETCH_RETRY_MAX_S` (issue #36): their blocks are recomputed at once instead
(:meth:`RemoteReads.kept_out`, asked by :meth:`~.peers.PeerMaps.ensure_mapped`), and a
read of it already planned fails at once (:class:`PeerKeptOutError`, not a new failure).
A read that works ends the keep-out; a failure long after the last keep-out ended starts
the doubling again.  A read refused for reasons of this rank's own (staging rows busy,
rows not all written) keeps nobody out.  A read still waiting when a world update says its
peer left or moved is abandoned at once (:meth:`RemoteReads.abandon`,
:class:`PeerLeftError`, counted in ``remote_reads_abandoned``): with a dark host, the
request behind it recomputes once the registry dropped the host's ranks (about 10 s), not
after the full timeout.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, Dict, List, Set

import numpy as np
import torch
from xoscar.errors import ServerClosed

from ..mechanism.load_handle import FetchedRows
from ..mechanism.read_checks import SourceIdentity
from ..mechanism.snapshot_storage import open_shm
from ..planning.counters import SharedCounters
from ..planning.load_batch import Tier
from ..planning.log_names import package_logger
from ..planning.rank_backoff import RankBackoff
from .actor_bridge import ActorBridge, wait_for_call

logger = package_logger(__name__)

#: longest a read through the rank's actor may take
FETCH_TIMEOUT_S = 30.0
#: a peer whose read failed for want of it is kept out of loads this long, then doubled
FETCH_RETRY_S = 5.0
FETCH_RETRY_MAX_S = 60.0
#: failures that say the peer (or the way to it) is not there
PEER_FAILURES = (TimeoutError, ConnectionError, OSError, ServerClosed)
_monotonic = time.monotonic  # the keep-out clock (tests move it)


class PeerKeptOutError(RuntimeError):
    """A read of a peer kept out of loads now (its blocks are recomputed)."""


class PeerLeftError(RuntimeError):
    """A read abandoned while it waited: a world update said its peer left or moved."""


class RemoteReads:
    """One worker's reads of other hosts' storages (see the module docstring)."""

    def __init__(self, rank: int, tp_rank: int, bridge: ActorBridge,
                 counters: SharedCounters) -> None:
        self._rank, self._tp_rank = rank, tp_rank
        self._bridge, self._counters = bridge, counters
        #: staging row set -> group -> per-layer rows (set 0 from the descriptor at open, a
        #: later one when a fetch's answer first names it; completion thread only)
        self._staging: Dict[int, Dict[int, List[torch.Tensor]]] = {}
        self._lock = threading.Lock()  # (the keep-outs: completion and step threads)
        self._backoff = RankBackoff(FETCH_RETRY_S, FETCH_RETRY_MAX_S, lambda: _monotonic())
        #: rank -> its reads waiting now (completion thread; abandoned by world updates),
        #: and how often it left (a read started as it left is abandoned too)
        self._waiting: Dict[int, Set[concurrent.futures.Future[Any]]] = {}
        self._departures: Dict[int, int] = {}

    def opened(self, staging: Any) -> None:
        """The rank's own staging rows (set 0) from the actor's descriptor."""
        self._staging = {0: {g: list(ts) for g, ts in open_shm(staging).items()}}

    def close(self) -> None:
        self._staging.clear()

    def kept_out(self, ranks: Set[int]) -> Set[int]:
        """The ranks of ``ranks`` whose rows loads leave out now."""
        if not self._backoff:
            return set()
        now = _monotonic()
        with self._lock:
            return {r for r in ranks if self._backoff.waiting(r, now)}

    def forget(self, rank: int) -> None:
        """``rank`` answered a read, or moved (a world update): no keep-out, no doubling."""
        with self._lock:
            self._backoff.forget(rank)

    def abandon(self, rank: int) -> int:
        """``rank`` left the world or moved: its reads waiting now fail at once
        (:class:`PeerLeftError`); how many."""
        with self._lock:
            waiting = self._waiting.pop(rank, set())
            self._departures[rank] = self._departures.get(rank, 0) + 1
        abandoned = sum(fut.cancel() for fut in waiting)
        if abandoned:
            self._counters.add("remote_reads_abandoned", abandoned)
            logger.warning("xavier: rank %d: %d read(s) of rank %d abandoned: it left the "
                           "world (recomputed)", self._rank, abandoned, rank)
        return abandoned

    def _wait(self, rank: int, call: Callable[[], Any]) -> Any:
        """``call``'s answer through the bridge, within :data:`FETCH_TIMEOUT_S`, abandoned
        by :meth:`abandon`."""
        with self._lock:
            departures = self._departures.get(rank, 0)
        fut = self._bridge.start(call)
        with self._lock:
            self._waiting.setdefault(rank, set()).add(fut)
            if self._departures.get(rank, 0) != departures:  # it left as this one started
                fut.cancel()
                self._counters.add("remote_reads_abandoned")
        try:
            return wait_for_call(fut, FETCH_TIMEOUT_S)
        except concurrent.futures.CancelledError:
            raise PeerLeftError(f"rank {rank} left the world while a read of it waited") \
                from None
        finally:
            with self._lock:
                self._waiting.get(rank, set()).discard(fut)

    def reader(self, own: Any, rank: int, tier: Tier) -> Callable[[Any], FetchedRows]:
        """Reads of ``rank``'s ``tier`` through this rank's transfer actor ``own``, which
        receives them (NIXL or sockets) into staging rows this process maps too: the row
        set its answer names (a second set exists once a fetch timed out and still ran
        when the next one came: see :mod:`..mechanism.remote_fetch`)."""
        def fetch(transfer: Any) -> FetchedRows:
            if self.kept_out({rank}):  # (planned before its keep-out: one timeout is enough)
                raise PeerKeptOutError(f"rank {rank}: kept out of loads after a failed read")
            slots = [int(s) for s in transfer.src_slots]
            group = int(transfer.group)
            tp_rank = self._tp_rank
            try:
                served, index = self._wait(
                    rank, lambda: own.fetch_blocks(rank, int(tier), group, slots, tp_rank))
            except PEER_FAILURES as exc:
                self._keep_out(rank, exc)
                raise
            self.forget(rank)  # (it answers: no keep-out, no doubling)
            _, incarnation, generations = served
            return FetchedRows([s[:len(slots)] for s in self._staging_set(own, int(index))[group]],
                               SourceIdentity(int(incarnation), np.asarray(generations, np.int64)))

        return fetch

    def _keep_out(self, rank: int, exc: BaseException) -> None:
        with self._lock:
            wait = self._backoff.failed(rank)
        self._counters.add("peers_kept_out")
        logger.warning("xavier: rank %d: a read of rank %d failed (%r): its rows are left out "
                       "of loads (recomputed) for %.0f s", self._rank, rank, exc, wait)

    def _staging_set(self, own: Any, index: int) -> Dict[int, List[torch.Tensor]]:
        """Staging row set ``index``, mapped on first use (completion thread only)."""
        rows = self._staging.get(index)
        if rows is None:
            tp_rank = self._tp_rank
            handles = self._bridge.call(lambda: own.staging_handles(tp_rank, index),
                                        FETCH_TIMEOUT_S)
            rows = {g: list(ts) for g, ts in open_shm(handles).items()}
            self._staging[index] = rows
            logger.info("xavier: rank %d: staging row set %d mapped (a remote fetch timed "
                        "out and was still running when the next one came)", self._rank,
                        index)
        return rows
