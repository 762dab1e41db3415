"""One scheduler step's work for the workers: the typed object vLLM carries from the
connector's scheduler half to every worker (pickled once per step).

:class:`StepMeta` holds ONE :class:`~.load_batch.LoadBatch` with every request's loads, the
newly full blocks to export and the step's figures (:class:`StepStats`).
Built by :class:`~.scheduler_side.SchedulerSide`; a tensor-parallel worker takes its
shard's part of it (:meth:`StepMeta.for_shard`).  Pure: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .load_batch import LoadBatch, empty_batch

#: (group, block name, block_id) of a newly computed full block
ExportRow = Tuple[int, int, int]
#: (group, block name, block_id, generation): a block published in place (vLLM's cache)
InPlaceRow = Tuple[int, int, int, int]


@dataclass
class StepStats:
    """The scheduler side's figures of one step (the worker adds them to the rank's
    counters)."""

    queries: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    requests_with_hits: int = 0
    steps_with_loads: int = 0
    lookup_calls: int = 0
    lookups_deferred: int = 0
    lookups_given_up: int = 0
    lookup_wait_us: int = 0
    #: steps built, and the time vLLM's scheduling loop spent in the connector (µs)
    scheduler_steps: int = 0
    scheduler_us: int = 0
    #: steps whose loads were not a valid batch (a defect; recomputed)
    rejected_metadata: int = 0
    #: requests whose loads were dropped (recomputed): a block of theirs and another of
    #: the step had different names with equal low 63 bits (:mod:`.block_names`)
    identity_clashes: int = 0
    #: hits that reached their first forward, and where their time went (µs, summed)
    hits_started: int = 0
    hit_lookup_us: int = 0
    hit_load_wait_us: int = 0
    #: hit blocks whose destination was vLLM's null block (a sliding-window block outside
    #: the window): nothing loaded there
    null_blocks_skipped: int = 0
    #: hits answered from same-host peers' host indexes (no directory lookup), their blocks
    host_index_hits: int = 0
    host_index_blocks: int = 0
    #: same-host peers whose host indexes are mapped (a level, down to 0; -1: no index)
    host_index_peers: int = -1
    #: 1 while the mapped indexes are the whole launch's (misses answered without a
    #: lookup: :mod:`~..mechanism.host_holders`), 0 when not, -1: no index
    host_index_whole_launch: int = -1
    #: steps whose forgets went in one directory call with an earlier step's (one call
    #: out at a time: :mod:`.coalesced_forgets`)
    forgets_coalesced: int = 0
    #: vLLM's cache read in place: blocks published, published blocks vLLM handed out
    #: again (their entries forgotten), those of them saved into Xavier's tier, and those
    #: not saved since a same-host peer held them in its vLLM cache then, or since
    #: nothing showed them shared (``xavier_save_victims`` shared)
    in_place_published: int = 0
    in_place_reused: int = 0
    in_place_victims: int = 0
    in_place_victims_held_elsewhere: int = 0
    in_place_victims_never_shared: int = 0
    #: reads of Xavier's tiers leased (asked for when their step was built)
    leases_asked: int = 0
    #: directory calls releasing leases that failed (each is tried again)
    lease_release_failures: int = 0
    #: the cost model (:mod:`.load_cost`): hits judged not worth loading, those of them
    #: declined (``xavier_load_policy`` cost; vLLM computed them) and their tokens,
    #: requests not even looked up (all of their candidate blocks would not pay)
    hits_not_paying: int = 0
    hits_declined: int = 0
    hit_tokens_declined: int = 0
    lookups_skipped_not_paying: int = 0
    lookups_skipped_held_nowhere: int = 0  # no rank of the launch holds the first block
    #: its latest estimates (levels, 0 while unknown; the counters keep the last known):
    #: prefill ns per token, a step's fixed µs, a hit's expected wait (µs) at the latest
    #: measured hit's load level
    cost_prefill_ns_per_token: int = 0
    cost_step_fixed_us: int = 0
    cost_hit_wait_us: int = 0

    def as_dict(self) -> Dict[str, int]:
        return dict(vars(self))


@dataclass
class StepMeta:
    """One step's work for the worker (pickled by vLLM from the scheduler to the worker):
    ONE :class:`~.load_batch.LoadBatch` with every request's loads, the newly full blocks
    to export, the step's figures.  No lease travels: the scheduler half holds the loads'
    leases and releases them when vLLM reports the loads finished on every worker
    (:meth:`~.scheduler_side.SchedulerSide.loads_finished`).

    ``failed_dests``: destinations of loads the scheduler could not express as a valid
    batch (a defect, logged there): the worker reports them failed so that vLLM recomputes
    them; their requests are in ``loads`` with no rows.

    With vLLM's cache read in place (:mod:`.in_place`): ``in_place``, the newly full blocks
    to publish once the step's forward completed (no copy; ``exports`` is then empty), and
    ``saves``, published blocks vLLM handed out this step, to be copied into Xavier's tier
    before anything of the step writes them."""

    loads: LoadBatch = field(default_factory=empty_batch)
    exports: Tuple[ExportRow, ...] = ()
    stats: StepStats = field(default_factory=StepStats)
    failed_dests: Tuple[int, ...] = ()
    in_place: Tuple[InPlaceRow, ...] = ()
    saves: Tuple[ExportRow, ...] = ()
    #: vLLM scheduled no token this step nor the one before (only the connector runs: the
    #: worker may wait a little for a load in flight, ``WorkerDataPlane.finished``)
    idle: bool = False
    #: ``in_place`` goes into the workers' host indexes only, not the directory: the whole
    #: launch is on this host (``xavier_local_publish``; :mod:`~..mechanism.publisher`)
    in_place_local: bool = False

    @property
    def has_loads(self) -> bool:
        return self.loads.num_requests > 0

    def for_shard(self, tp_rank: int, tp_size: int) -> StepMeta:
        """What TP worker ``tp_rank`` does of this step: the rows of its shard
        (:meth:`~.load_batch.LoadBatch.for_shard`); every request, the
        exports and ``failed_dests`` stay (each worker exports, publishes and saves its
        shard of every block and reports the failed blocks; vLLM recomputes a block any
        worker failed on all of them).  ``tp_size == 1``: this step."""
        if tp_size == 1:
            return self
        return StepMeta(self.loads.for_shard(tp_rank, tp_size), self.exports, self.stats,
                        self.failed_dests, self.in_place, self.saves, self.idle,
                        self.in_place_local)

    def per_request(self, loads: Optional[LoadBatch] = None) -> List[LoadBatch]:
        """The step's loads as one batch per request (the per-request baseline: one load
        call each).  ``loads``: the step's batch after rows were dropped
        (the same requests, in the same order); default the step's own."""
        batch = self.loads if loads is None else loads
        if batch.request_ids != self.loads.request_ids:
            raise ValueError("loads: not the step's requests")
        return batch.split()


class EmptySteps:
    """Which steps are :attr:`StepMeta.idle`: no token scheduled in them nor in the step
    before.  The first empty step after a forward is not: under async scheduling the
    forward's outputs are processed after the next step was launched, and must not wait
    behind it."""

    def __init__(self) -> None:
        self._last_empty = False

    def idle(self, scheduled_tokens: int) -> bool:
        """The next step scheduled ``scheduled_tokens``: is it idle?"""
        empty = scheduled_tokens == 0
        idle, self._last_empty = empty and self._last_empty, empty
        return idle
