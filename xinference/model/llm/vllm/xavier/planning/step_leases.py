"""The leases of one replica's loads, taken and released in one place (pure).

Every lease this replica takes is taken and released here, like vLLM's offloading
``prepare_load`` / ``complete_load`` or SGLang's lock references.  None travels to a
worker.  A lookup's answer holds none (a request waiting in vLLM's queue pins no source
slot); the step that carries a load asks for leases on its reads of Xavier's own tiers
(vLLM's cache read in place needs none), once vLLM allocated the destinations
(:meth:`StepLeases.take`, from :meth:`~.scheduler_side.SchedulerSide.build_step`), and
:meth:`StepLeases.loads_finished` releases them once vLLM's aggregation of the workers'
``get_finished`` says every worker is done with the request's load -- after its copies
completed and its reads were checked (a worker reports a load only then,
``LoadCompletion``; except a load whose launch failed: reported at once with every
destination failed, its queued copies still ordered before vLLM's stream, so a slot reused
under them can only spoil blocks vLLM recomputes).  A lease only keeps Xavier's own tiers
from reusing a slot during the copy; a read is correct without it, since every read is
checked after its copy (a slot reused before the lease arrived fails its check and is
recomputed).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .log_names import package_logger
from .step_loads import StepLoad

logger = package_logger(__name__)

#: release lease ids (fire and forget is fine: a late release only delays eviction)
ReleaseFn = Callable[[Sequence[int]], None]
#: asks the directory for leases on these locations (rows of
#: :class:`~.directory_types.Location` fields);
#: the future gives one id per location (``NO_LEASE`` where none was granted)
TakeLeasesFn = Callable[[np.ndarray], "concurrent.futures.Future[List[int]]"]
#: the leases of one request's load: the step's lease call and the request's slice of it
_Held = Tuple["concurrent.futures.Future[List[int]]", int, int]


class StepLeases:
    """The leases of the loads sent to the workers, per request, until vLLM reports the
    loads finished (module docstring)."""

    def __init__(self, release: ReleaseFn, take_leases: Optional[TakeLeasesFn],
                 rank: int = 0) -> None:
        self._release, self._take_leases, self._rank = release, take_leases, rank
        self._in_flight: Dict[str, List[_Held]] = {}

    def take(self, loads: Sequence[StepLoad]) -> int:
        """ONE directory call for the leases of the step's reads of Xavier's tiers (nobody
        waits for it); each request keeps its slice until its load is reported done.
        Returns how many leases were asked for."""
        if self._take_leases is None or not any(len(x.lease_rows) for x in loads):
            return 0
        wanted = np.concatenate([x.lease_rows for x in loads])
        try:
            fut = self._take_leases(wanted)
        except Exception as exc:  # unprotected reads: still checked, at worst recomputed
            logger.warning("xavier: rank %d: asking for %d leases failed: %r", self._rank,
                           len(wanted), exc)
            return 0
        start = 0
        for x in loads:
            if len(x.lease_rows):
                self._in_flight.setdefault(x.request_id, []).append(
                    (fut, start, start + len(x.lease_rows)))
            start += len(x.lease_rows)
        return len(wanted)

    def loads_finished(self, request_ids: Iterable[str]) -> None:
        """These requests' loads are done on every worker: their leases are released (once
        granted, if the directory's answer is still on its way)."""
        for rid in request_ids:
            for fut, start, end in self._in_flight.pop(rid, ()):
                fut.add_done_callback(functools.partial(self._release_slice, start, end))

    def _release_slice(self, start: int, end: int,
                       fut: concurrent.futures.Future[List[int]]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # nothing was granted
        self._release(fut.result()[start:end])

    def close(self) -> List[concurrent.futures.Future[List[int]]]:
        """Release every lease still held (engine shutdown: no load report will come);
        returns the lease calls still unanswered.  Idempotent."""
        pending = [fut for ls in self._in_flight.values() for fut, _, _ in ls
                   if not fut.done()]
        self.loads_finished(list(self._in_flight))
        return pending

    @property
    def held(self) -> int:
        """Leases asked for loads in flight and not yet released (some may not have been
        granted)."""
        return sum(end - start for ls in self._in_flight.values() for _, start, end in ls)

    @property
    def loads_in_flight(self) -> int:
        """Requests whose load was sent and is not yet reported finished."""
        return len(self._in_flight)
