"""The scheduler half of the connector, without vLLM: lookups, leases, destinations, exports.

:class:`SchedulerSide` is driven by :class:`~..vllm_side.connector.XavierConnector` (scheduler
role), which translates vLLM's objects into plain values.  Contract:

* :meth:`SchedulerSide.track` (vLLM's ``on_new_request``) queues the request's directory
  lookup right away; the lookups of all requests that arrived since the last step go to
  the directory in ONE call (:class:`~.lookups.DirectoryLookups`).
* :meth:`SchedulerSide.match` answers vLLM's ``get_num_new_matched_tokens``: the blocks
  beyond the local hit that other ranks hold (never the block holding the prompt's last
  token: vLLM must compute at least one token), or ``None`` while the lookup is still
  out (vLLM asks again next step; the wait is bounded per step).  A hit holds no lease;
  asking again for the same request reuses the hit when the local hit did not move, else
  drops it and looks again.  A request is offered at most ONE load: once its hit was
  allocated (or declined: :mod:`.load_cost`), vLLM asking again means the load failed (or
  the request was preempted) and the answer is 0, so vLLM recomputes (else a dead source
  was retried ~1,300 times in 6 s on simulated hosts).
* :meth:`SchedulerSide.allocated` turns the hit into :class:`~.load_batch.BlockLoad`
  rows for the destination blocks vLLM allocated (null blocks skipped).
* :meth:`SchedulerSide.build_step` returns everything of one step in a
  :class:`StepMeta`: ONE load batch carrying every request's loads, the newly full
  blocks to export after the forward (with ``publish_loaded``, a loaded request's first
  computing step exports what its load wrote too), and the step's figures; it asks the
  directory, in ONE call nobody waits for, for leases on the step's reads of Xavier's tiers.
* :meth:`SchedulerSide.loads_finished` (vLLM's ``update_connector_output``: the loads
  every worker reported done, ``finished_recving``) releases those loads' leases.
* :meth:`SchedulerSide.finished` drops a request; the leases of a load in flight stay
  until vLLM reports the load done (vLLM keeps an aborted request's blocks until then).
* :meth:`SchedulerSide.close` releases every lease still held (engine shutdown).

Where a hit's time goes before its first forward, in the step figures: ``hit_lookup_us``
(arrival to the directory's answer being taken), ``hit_load_wait_us`` (blocks allocated
and load sent, to the request's first forward: vLLM's asynchronous load path), summed
over ``hits_started``.

Leases: every lease this replica takes is taken and released in one place,
:class:`~.step_leases.StepLeases` (its docstring says when and why)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .block_directory import QueryResult
from .directory_types import LOCATION_COLUMNS
from .load_cost import LoadCost, WaitKey
from .lookups import DirectoryLookups, State
from .shards import Shards
from .step_leases import ReleaseFn, StepLeases, TakeLeasesFn
from .step_loads import StepLoad, hit_rows, step_batch
from .step_meta import ExportRow, StepMeta, StepStats

#: the longest prefix of these block names that one same-host peer holds (its host index,
#: :mod:`~..mechanism.host_holders`), as the directory would answer it, and whether the block
#: after it was held there once (Xavier's tiers may hold it now); None: no hit; a hit of no
#: block: no rank of the launch holds the first (a directory lookup could only miss)
HostFind = Callable[[Sequence[int]], Optional[Tuple[QueryResult, bool]]]


@dataclass
class _Hit:
    first_block: int
    keys: Tuple[int, ...]
    result: QueryResult  # group-major locations/leases of exactly ``keys``


@dataclass
class _Tracked:
    """What the scheduler side knows of a live request."""

    keys: Callable[[], Sequence[int]]
    block_ids: List[List[int]] = field(default_factory=list)  # per group
    null: List[List[bool]] = field(default_factory=list)
    sharing: bool = True
    #: whether it may load (vLLM reads no prefix cache for some requests, e.g. those
    #: asking for prompt logprobs: they are still exported)
    loads: bool = True
    #: a load was planned for it: it is never offered another one
    loaded: bool = False
    loaded_span: Tuple[int, int] = (0, 0)  # the blocks [first, end) its load wrote
    declined: bool = False  # its hit did not pay (:mod:`.load_cost`): vLLM computes it
    wait_key: Optional[WaitKey] = None  # the cost model's key when its blocks were allocated
    lookup_s: Optional[float] = 0.0  # its lookup's time, asked to answered (None: none)
    #: clock readings: tracked, its hit answered, its load allocated (None: not yet)
    arrived_at: float = 0.0
    answered_at: Optional[float] = None
    allocated_at: Optional[float] = None


class SchedulerSide:
    """See the module docstring."""

    def __init__(self, rank: int, block_size: int, num_groups: int,
                 lookups: DirectoryLookups, release: ReleaseFn,
                 take_leases: Optional[TakeLeasesFn] = None,
                 clock: Callable[[], float] = time.monotonic, tp_size: int = 1,
                 cost: Optional[LoadCost] = None, decline: bool = False,
                 on_host: Optional[HostFind] = None, publish_loaded: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.rank = rank
        self.block_size = block_size
        self.num_groups = num_groups
        #: the directory groups of this replica's shards (a lookup asks for all of them)
        self.shards = Shards(num_groups, tp_size)
        self.lookups = lookups
        self.leases = StepLeases(release, take_leases, rank)
        self._clock = clock
        self._hits: Dict[str, _Hit] = {}
        self._tracked: Dict[str, _Tracked] = {}
        #: the loads of the step being built, one per request
        self._step_loads: List[StepLoad] = []
        self._stats = StepStats()
        self.cost = cost  # a hit against its recompute (``decline``: one that does not pay
        self._decline = decline and cost is not None  # is not loaded; else only counted)
        self._running: Set[str] = set()  # the live requests the last step scheduled
        self._waiting: Set[str] = set()  # hits allocated, not yet at their first forward
        #: the longest prefix same-host peers hold, from their host indexes (no round trip)
        self._on_host = on_host
        self._publish_loaded = publish_loaded  # (a loader holds what it loaded, too)

    def _others(self, request_id: str) -> int:
        """Requests beside ``request_id``: those the last step ran, and hits waiting."""
        beside = self._running | self._waiting
        return len(beside) - (request_id in beside)

    # ----------------------------------------------------------------- lookup
    def track(self, request_id: str, keys: Callable[[], Sequence[int]], num_tokens: int,
              sharing: bool = True, ready: bool = True, loads: bool = True) -> None:
        """Start tracking a request (vLLM's ``on_new_request``); when sharing, ready and
        allowed to load, queue its lookup of every block it could load (from its first)."""
        if request_id in self._tracked:
            return
        self._tracked[request_id] = _Tracked(keys=keys, sharing=sharing, loads=loads,
                                             arrived_at=self._clock())
        if sharing and ready and loads:
            last = self._last_block(keys(), num_tokens)
            host = self._host_hit(keys()[:last]) if last > 0 else None
            held = host[0].num_hits if host is not None else 0  # the directory: for the rest
            if held < last and (host is None or held):
                self.lookups.ask(request_id, held, keys()[held:last])

    def _host_hit(self, keys: Sequence[int]) -> Optional[Tuple[QueryResult, bool]]:
        """The longest prefix of ``keys`` a same-host peer holds (None: none) (:data:`HostFind`)."""
        return self._on_host(keys) if self._on_host is not None and len(keys) else None

    def _last_block(self, keys: Sequence[int], num_tokens: int) -> int:
        # blocks entirely within the first num_tokens - 1 tokens: vLLM computes >= 1 token
        return min(len(keys), max(0, num_tokens - 1) // self.block_size)

    def match(self, request_id: str, num_tokens: int, num_computed_tokens: int,
              ready: bool = True) -> Optional[int]:
        """External tokens loadable beyond ``num_computed_tokens`` (block aligned), or
        ``None`` while the lookup is out."""
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.loaded:
            # its load failed (or it was preempted): the time until its first forward is
            # a recompute's, not a hit's wait (one dark peer's 30 s timeout, learned, made
            # the cost model decline every hit of its level for the next 31)
            tracked.allocated_at = None
            self._waiting.discard(request_id)
        if (tracked is None or not tracked.sharing or not tracked.loads or not ready
                or tracked.loaded or tracked.declined):
            self._drop_hit(request_id)
            self.lookups.drop(request_id)
            return 0
        first = num_computed_tokens // self.block_size
        keys = tracked.keys()
        last = self._last_block(keys, num_tokens)
        held = self._hits.get(request_id)
        if held is not None and held.first_block == first:
            return len(held.keys) * self.block_size  # vLLM asks again: same answer
        self._drop_hit(request_id)
        if last <= first:
            self.lookups.drop(request_id)
            return 0
        host = self._host_hit(keys[first:last])
        if host is not None and not host[0].num_hits:  # no rank holds the start ...
            if not self.lookups.answered(request_id):  # ... a miss now, not looked up
                self._stats.lookups_skipped_held_nowhere += 1
                self.lookups.drop(request_id)
                return 0
            host = None  # (the directory answered already: its answer, as before)
        if host is not None:  # a same-host peer holds the start: no directory round trip
            return self._keep_host(request_id, keys, first, last, *host)
        if self._decline and self.cost is not None and not self.cost.worth_looking_up(
                (last - first) * self.block_size, self._others(request_id),
                not self.lookups.answered(request_id)):
            self._stats.lookups_skipped_not_paying += 1  # not even all of it would pay
            tracked.declined = True
            self.lookups.drop(request_id)
            return 0
        state, lookup = self.lookups.take(request_id)
        if state is State.NONE:  # arrived before sharing was ready, preempted, or re-asked
            self.lookups.ask(request_id, first, keys[first:last])
            state, lookup = self.lookups.take(request_id)
        if state is State.PENDING:
            return None
        if state is State.MISS or lookup is None or lookup.result is None:
            return 0
        self._stats.queries += 1
        self._stats.queried_blocks += len(lookup.keys)
        result, start = lookup.result, lookup.start
        tracked.lookup_s = (lookup.answered_at or lookup.asked_at) - lookup.asked_at
        end = min(start + result.num_hits, last)
        if start > first or end <= first:
            if start != first and last > first:
                # the answer covers only blocks this replica has itself, or starts after
                # `first` (asked after a host hit that is gone now): ask from `first`
                self.lookups.ask(request_id, first, keys[first:last])
                state, lookup = self.lookups.take(request_id)
                if state is State.PENDING:
                    return None
                if state is State.DONE and lookup is not None and lookup.result is not None:
                    result, start = lookup.result, lookup.start
                    end = min(start + result.num_hits, last)
                    if end > first:
                        return self._keep(request_id, keys, first, end, start, result)
            return 0
        return self._keep(request_id, keys, first, end, start, result)

    def _keep_host(self, request_id: str, keys: Sequence[int], first: int, last: int,
                   host: QueryResult, evicted_next: bool) -> Optional[int]:
        """Hold the hit same-host peers' host indexes answered from block ``first``, followed
        by the directory's answer for the blocks after it (asked at arrival): taken if it
        is there; waited for (within the step's budget, else ``None``: vLLM asks again)
        only when the block after the host hit was held on this host once -- vLLM handed it
        out, so Xavier's tiers may hold it.  Otherwise nobody of this host ever computed
        it and the directory's answer is not waited for (only another host could hold
        it)."""
        end = first + host.num_hits
        state, lookup = State.NONE, None
        if end < last and (evicted_next or self.lookups.answered(request_id)):
            state, lookup = self.lookups.take(request_id)
            if state is State.NONE and evicted_next:
                self.lookups.ask(request_id, end, keys[end:last])
                state, lookup = self.lookups.take(request_id)
            if state is State.PENDING:
                return None
        if state is State.DONE and lookup is not None and lookup.result is not None:
            self._stats.queries += 1
            self._stats.queried_blocks += len(lookup.keys)
            if lookup.start <= end < lookup.start + lookup.result.num_hits:
                host = host.followed_by(lookup.result, last - end, end - lookup.start)
        self.lookups.drop(request_id)
        self._tracked[request_id].lookup_s = None  # (no lookup: not a lookup's time)
        kept = self._keep(request_id, keys, first, first + host.num_hits, first, host)
        if kept:  # (a hit the cost model declined is no hit)
            self._stats.host_index_hits += 1
            self._stats.host_index_blocks += end - first
        return kept

    def _keep(self, request_id: str, keys: Sequence[int], first: int, end: int, start: int,
              result: QueryResult) -> int:
        """Hold the hit of blocks ``[first, end)`` from ``result`` (which starts at block
        ``start``)."""
        hits = result.num_hits
        groups = len(result.table) // max(1, hits)
        lo, hi = first - start, end - start
        if lo < 0:  # (match asks from `first`: an answer starting later holds no hit)
            return 0
        if not self._worth_loading(request_id, (end - first) * self.block_size):
            return 0
        table = result.table.reshape(groups, hits, LOCATION_COLUMNS)[:, lo:hi]
        leases = result.lease_table.reshape(groups, hits)[:, lo:hi]
        kept = tuple(int(k) for k in keys[first:end])
        self._hits[request_id] = _Hit(first, kept, QueryResult(
            kept, table.reshape(-1, LOCATION_COLUMNS), leases.reshape(-1)))
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.answered_at is None:
            tracked.answered_at = self._clock()
        return (end - first) * self.block_size

    def _worth_loading(self, request_id: str, tokens: int) -> bool:
        """The cost model's word on a hit of ``tokens`` tokens (counted; False: declined)."""
        if self.cost is None:
            return True
        pays, load = self.cost.judge(tokens, self._others(request_id), self._decline)
        self._stats.hits_not_paying += not pays
        if not load:
            self._stats.hits_declined += 1
            self._stats.hit_tokens_declined += tokens
            self._tracked[request_id].declined = True
        return load

    # ------------------------------------------------------------ allocation
    def allocated(self, request_id: str, block_ids: Sequence[Sequence[int]],
                  null: Sequence[Sequence[bool]], num_external_tokens: int) -> int:
        """Record the request's blocks; returns the number of block loads queued."""
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            tracked.block_ids = [list(b) for b in block_ids]
            tracked.null = [list(n) for n in null]
        hit = self._hits.pop(request_id, None)
        if hit is None:
            return 0
        if num_external_tokens <= 0:
            return 0
        n = num_external_tokens // self.block_size
        if n > len(hit.keys) or num_external_tokens % self.block_size:
            raise ValueError(f"num_external_tokens: {num_external_tokens} is not a block "
                             f"multiple of at most {len(hit.keys)} offered blocks")
        load, skipped = hit_rows(request_id, hit.keys, hit.first_block, hit.result.table, n,
                                 block_ids, null, self.shards.tp_size)
        self._stats.null_blocks_skipped += skipped
        if tracked is not None:
            tracked.loaded = True
            tracked.loaded_span = (hit.first_block, hit.first_block + n)
            tracked.allocated_at = self._clock()
            self._waiting.add(request_id)
            if self.cost is not None:
                tracked.wait_key = self.cost.wait_key(self._others(request_id))
        self._step_loads.append(load)
        self._stats.hit_blocks += n
        self._stats.hit_tokens += num_external_tokens
        self._stats.requests_with_hits += 1
        return len(load.rows)

    # ------------------------------------------------------------------ steps
    def build_step(self, scheduled: Sequence[Tuple[str, int, int]],
                   new_blocks: Dict[str, Tuple[Optional[Sequence[Sequence[int]]], bool]],
                   ) -> StepMeta:
        """``scheduled``: ``(request_id, num_computed_tokens, num_scheduled_tokens)``;
        ``new_blocks``: request_id -> (new block ids per group or None, replace) for
        requests already running (``replace`` when resumed after preemption)."""
        for rid, (blocks, replace) in new_blocks.items():
            tracked = self._tracked.get(rid)
            if tracked is None or blocks is None:
                continue
            if replace or not tracked.block_ids:
                tracked.block_ids = [list(b) for b in blocks]
                tracked.null = [[False] * len(b) for b in blocks]
            else:
                for g, b in enumerate(blocks):
                    tracked.block_ids[g].extend(b)
                    tracked.null[g].extend([False] * len(b))
        exports: List[ExportRow] = []
        now = self._clock()
        loading_now = {load.request_id for load in self._step_loads}
        for rid, computed, num_new in scheduled:
            tracked = self._tracked.get(rid)
            start = computed // self.block_size
            if tracked is not None and tracked.allocated_at is not None and num_new > 0:
                if self._publish_loaded and rid not in loading_now:  # (vLLM recomputes
                    start = min(start, tracked.loaded_span[0])  # from a failed read on)
                self._stats.hits_started += 1
                self._stats.hit_lookup_us += round(1e6 * ((tracked.answered_at or now)
                                                          - tracked.arrived_at))
                self._stats.hit_load_wait_us += round(1e6 * (now - tracked.allocated_at))
                if self.cost is not None and tracked.wait_key is not None:
                    self.cost.hit_waited(now - tracked.allocated_at, tracked.wait_key,
                                         tracked.lookup_s)
                tracked.allocated_at = None
                self._waiting.discard(rid)
            if tracked is None or not tracked.sharing or not tracked.block_ids:
                continue
            keys = tracked.keys()
            end = min(len(keys), (computed + num_new) // self.block_size)
            for g, ids in enumerate(tracked.block_ids):
                for i in range(start, min(end, len(ids))):
                    if not tracked.null[g][i]:
                        exports.append((g, int(keys[i]), int(ids[i])))
        self._measure_step(now, scheduled)
        self._widen_waits(scheduled)
        self.lookups.flush()  # lookups of requests vLLM did not reach this step: on their way
        self.lookups.new_step()
        for name, value in self.lookups.take_stats().items():
            setattr(self._stats, name, getattr(self._stats, name) + value)
        self._stats.scheduler_steps += 1
        meta = self._take_loads()
        meta.exports = tuple(exports)
        return meta

    def _measure_step(self, now: float, scheduled: Sequence[Tuple[str, int, int]]) -> None:
        self._running = {rid for rid, _, num_new in scheduled if num_new > 0}
        if self.cost is not None:
            self.cost.step(now, sum(n for _, _, n in scheduled), self._stats.scheduler_us / 1e6)
            for name, value in self.cost.figures().items():
                setattr(self._stats, name, value)

    def _widen_waits(self, scheduled: Sequence[Tuple[str, int, int]]) -> None:
        """Hits still waiting for their first forward waited through this step too, beside
        the requests it runs and the other hits waiting: their wait is kept under the
        busiest load they saw (:meth:`~.load_cost.LoadCost.widened`; a burst's 16 hits,
        allocated one by one in one long schedule, wait beside each other)."""
        if self.cost is None or not self._waiting:
            return
        tokens = sum(n for _, _, n in scheduled)
        others = len(self._running | self._waiting) - 1  # (each is one of the waiting)
        for rid in self._waiting:
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.wait_key is not None:
                tracked.wait_key = self.cost.widened(tracked.wait_key, others, tokens)

    def add_time(self, us: int) -> None:
        """Time (µs) the connector's scheduler methods took (counted per step)."""
        self._stats.scheduler_us += us

    def _take_loads(self) -> StepMeta:
        loads, self._step_loads = self._step_loads, []
        stats, self._stats = self._stats, StepStats()
        meta, reads = step_batch(loads, stats, self.rank)
        if reads:  # the reads this step really makes (a dropped request reads nothing)
            stats.leases_asked += self.leases.take(reads)
        return meta

    # ----------------------------------------------------------------- finish
    def loads_finished(self, request_ids: Iterable[str]) -> None:
        """vLLM's ``finished_recving``: every worker reported these requests' loads done
        (copies complete, reads checked); their leases are released."""
        self.leases.loads_finished(request_ids)

    def finished(self, request_id: str) -> None:
        """The request is done or aborted: its tracking, lookup and hit go.  A load in
        flight keeps its leases until :meth:`loads_finished` (vLLM reports an aborted
        request's load when it ends, and frees its blocks only then)."""
        self._drop_hit(request_id)
        self.lookups.drop(request_id)
        self._tracked.pop(request_id, None)
        self._waiting.discard(request_id)
        self._running.discard(request_id)
        if not self._tracked and self.cost is not None:
            self.cost.idle()  # vLLM builds no step until a request arrives

    def close(self) -> List[concurrent.futures.Future[List[int]]]:
        """Release every lease still held (engine shutdown: no load report will come);
        returns the lease calls still unanswered (their leases go when they are, which a
        caller may wait for).  Idempotent."""
        self._hits.clear()
        self._step_loads.clear()  # not leased yet
        pending = self.leases.close()
        self.lookups.close()
        return pending

    def _drop_hit(self, request_id: str) -> None:
        self._hits.pop(request_id, None)

    @property
    def held_leases(self) -> int:
        return self.leases.held

    @property
    def loads_in_flight(self) -> int:
        return self.leases.loads_in_flight

    @property
    def tracked(self) -> int:
        return len(self._tracked)
