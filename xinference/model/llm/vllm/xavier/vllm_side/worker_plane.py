"""The data plane of one vLLM worker: loads, exports and peers, inside the worker process.

The worker owns the KV caches and the CUDA context, so it moves the bytes itself; no
xoscar call sits on a step's path for same-host traffic.  :class:`WorkerDataPlane`

* attaches to its rank's ``TransferActor`` once (:meth:`attach`): the actor allocates the
  rank's storage for this engine's KV layout, answers how to map it; the plane maps every
  tier (CUDA IPC / shared memory) and keeps its slots
  (:class:`~..mechanism.storage_writer.StorageWriter`);
* loads each step's blocks with ONE ``load_gpu_requests_v1``
  (:class:`~..mechanism.gpu_transfer.GPUTransfer`) on the engine's own CUDA stream
  (:meth:`load`); a peer of this host is mapped once (CUDA IPC or its shared-memory files),
  one of another host is read through the rank's transfer actor (NIXL or sockets);
* tells vLLM which requests' loads are done and which blocks failed (:meth:`finished`),
  ordering vLLM's stream after the copies first;
* exports each step's newly full blocks (:meth:`export`) without waiting;
* writes its counters into a shared-memory file the transfer actor reads (which bumps
  ``world_epoch`` there when a rank died or came back: the next load remaps).

In a tensor-parallel replica each worker has a plane for its shard of the KV heads: its
storage, its rows of each step (``StepMeta.for_shard``), shard ``tp_rank`` of every peer.

A request opted out of sharing never reaches it.  Test-only switches (faults, digests) live
in ``tests/support/worker_hooks.py``: a :class:`PlaneHooks` observer is called only when
``XAVIER_TEST_HOOKS`` (``module:Class``) names one in the engine's environment.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import numpy as np
import torch

from ..mechanism import block_copy_triton
from ..mechanism.gpu_transfer import GPUTransfer
from ..mechanism.in_place import InPlaceShare, SharedHostCaches
from ..mechanism.kv_schema import KVLayout, layout_of
from ..mechanism.load_handle import LoadHandle, wait_for_any, wait_until_reportable
from ..mechanism.quiet_gate import QuietGate
from ..mechanism.slot_generations import SlotGenerations
from ..mechanism.snapshot_storage import open_tier
from ..mechanism.storage_writer import StorageWriter
from ..planning.counters import GAUGE_NAMES, ZERO_LEVELS, SharedCounters
from ..planning.load_batch import DEST, RANK, TIER, LoadBatch, Tier
from ..planning.log_names import package_logger
from ..planning.options import XavierOptions
from ..planning.plan import SlabConfig
from ..planning.shards import Shards
from ..planning.step_meta import StepMeta
from ..planning.trace_spans import span
from .actor_bridge import ActorBridge, LazyActor
from .peers import PeerMaps
from .plane_hooks import PlaneHooks, load_test_hooks
from .tracker_link import writer_link

logger = package_logger(__name__)

#: longest an actor call of the plane may take (attach; registering waits ten times this)
CALL_TIMEOUT_S = 30.0
#: longest vLLM's ask for finished loads waits for the step's quick loads (a load's copies
#: into a 0.5B model's KV cache take ~0.15 ms for 512 blocks on an H200)
REPORT_WAIT_S = 0.002
#: longest a step with no forward waits for a load in flight to finish (:meth:`finished`)
IDLE_WAIT_S = 0.005
GroupedLayers = Dict[int, List[Tuple[str, torch.Tensor]]]


@dataclass
class _StepLoad:
    """One step's loads until vLLM is told they are done."""

    request_ids: Tuple[str, ...]
    handles: List[LoadHandle] = field(default_factory=list)
    failed: Set[int] = field(default_factory=set)
    #: why (part of) the step's loads were refused, if they were
    error: Optional[str] = None
    #: quick, but not checked yet when vLLM first asked (reported a step later)
    late: bool = False

    def reportable(self) -> bool:
        return all(h.reportable for h in self.handles)

    def quick(self) -> bool:
        """No load of it runs on the completion thread (device memory, or a CPU engine's
        copies): checked within about a copy's time of its launch, unless ordered after a
        forward in flight."""
        return bool(self.handles) and all(h.quick for h in self.handles)


class WorkerDataPlane:
    """See the module docstring.  Built by the worker connector at ``register_kv_caches``."""

    def __init__(self, options: XavierOptions, bridge: ActorBridge, caches: GroupedLayers,
                 block_dims: Dict[int, int], tp_rank: int = 0, tp_size: int = 1,
                 num_blocks: int = 0, shared_host: Optional[SharedHostCaches] = None,
                 defers_block_frees: bool = False, overlapped: bool = True) -> None:
        self.options = options
        self.rank = options.rank
        #: this worker's place in its tensor-parallel replica (it holds shard ``tp_rank``)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shards = Shards(max(1, len(caches)), tp_size)
        self._bridge = bridge
        self._transfer = LazyActor(bridge, options.rank_address, options.transfer_actor_uid)
        self._tracker = LazyActor(bridge, options.block_tracker_address,
                                  options.block_tracker_uid, checked=False)
        self.counters = SharedCounters.create()
        self.layout: KVLayout = layout_of(caches, block_dims, tp_size)
        self.device = next(t for layers in caches.values() for _, t in layers).device
        slabs = SlabConfig(full_rows=options.slab_blocks, small_rows=min(32, options.slab_blocks))
        self.engine = GPUTransfer(self.rank, slab_config=slabs, counters=self.counters)
        self.engine.set_local_caches(caches, block_dims)
        self.writer: Optional[StorageWriter] = None
        self.batched_loads, self.saves_dropped = options.batched_loads, False  # (benchmarks)
        #: loads and victim saves not ordered after the forward in flight (:meth:`load`):
        #: only where vLLM defers frees, and with vLLM's cache read in place (else the
        #: exports, on the loads' stream, wait for every forward anyway)
        self.unordered = defers_block_frees and options.in_place
        #: :meth:`finished` waits for quick loads when no copy waits for a forward in flight
        self.report_waits = self.unordered or not overlapped
        self._attached, self._own_releases = False, cast(List[Any], [])
        self.peers = PeerMaps(self.rank, options, bridge, self._transfer, self.engine,
                              self.counters, pin=self.device.type == "cuda", tp_rank=tp_rank,
                              layout=self.layout)
        self._pending: List[_StepLoad] = []
        self._closed = False
        #: vLLM's cache read in place by peers (``options.in_place``): its block generations,
        #: how peers map it (handed to the transfer actor at attach), the host index
        self.in_place: Optional[InPlaceShare] = None
        self._shared_host = shared_host
        if options.in_place and num_blocks > 0:
            self.in_place = InPlaceShare.create(
                {g: [t for _, t in ls] for g, ls in caches.items()}, block_dims, num_blocks,
                shared_host, self.rank, tp_rank, options.host_index,
                options.gpu_budget_bytes + options.cpu_budget_bytes)
        self.hooks: Optional[PlaneHooks] = load_test_hooks(self)

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def engine_views(self) -> Dict[int, List[torch.Tensor]]:
        return self.engine.local_block_views

    # -------------------------------------------------------------- attaching
    def attach(self, force: bool = False, raise_errors: bool = False) -> bool:
        """Register this engine with the rank's transfer actor (at most once a second
        unless ``force``) and map the storage it allocates.  ``raise_errors``: a refused
        registration (e.g. a budget that holds no block) raises instead of being logged."""
        if self._attached or self._closed:
            return self._attached
        if force:
            self._transfer.forget()
        ref = self._transfer.get(timeout=CALL_TIMEOUT_S)
        if ref is None:
            return False
        opts = self.options
        device = str(self.device)
        path = self.counters.path
        in_place = self.in_place.handles if self.in_place is not None else None
        try:
            desc = self._bridge.call(lambda: ref.register_engine(
                self.layout, opts, owner=os.getpid(), device=device, counters_path=path,
                tp_rank=self.tp_rank, in_place=in_place), timeout=CALL_TIMEOUT_S * 10)
            self._open_storage(desc)
        except Exception as exc:
            logger.warning("xavier: rank %d: registering the KV caches failed: %s",
                           self.rank, exc)
            self._transfer.forget()
            if raise_errors:
                raise
            return False
        self._attached = True
        self._warm_copy_kernel()
        self.peers.start()  # peers of this host mapped before a load needs them
        logger.info("xavier: rank %d attached to its transfer actor (layout %s, tiers %s)",
                    self.rank, self.layout.fingerprint(),
                    ", ".join(t.name for t in self.writer.tiers) if self.writer else "-")
        return True

    def _warm_copy_kernel(self) -> None:
        """Compile the fused copy for this engine's and its storage's layouts now, not in
        the first steps that export, demote or load (``copy_warm_us``)."""
        if self.device.type != "cuda" or self.writer is None:
            return
        t0 = time.perf_counter()
        sets = [views for views in self.engine_views.values()]
        sets += [self.writer.views(tier, g) for tier in self.writer.tiers
                 for g in self.engine_views]
        try:
            variants = block_copy_triton.warm(sets)
        except Exception as exc:  # never a reason not to share: it compiles on first use
            logger.warning("xavier: rank %d: compiling the copy kernel ahead failed: %r",
                           self.rank, exc)
            return
        self.counters.add("copy_warm_us", int(1e6 * (time.perf_counter() - t0)))
        logger.info("xavier: rank %d: copy kernel compiled for %d layout pairs", self.rank,
                    variants)

    def _open_storage(self, desc: Dict[str, Any]) -> None:
        link = writer_link(self._bridge, self._tracker, self.rank, self.shards, self.tp_rank,
                           self.in_place.index if self.in_place is not None else None)
        pin = self.device.type == "cuda"  # (the link first: it announces the host index)
        tiers: Dict[Tier, Dict[int, List[torch.Tensor]]] = {}
        for tier, (kind, handles) in sorted(desc["tiers"].items()):
            caches, release = open_tier(kind, handles, pin=pin)
            tiers[Tier(tier)] = caches
            self._own_releases.append(release)
        generations = SlotGenerations.open(desc["generations"])
        self._own_releases.append(generations.close)
        quiet_s = self.options.quiet_ms / 1000  # (background work: not inside a hit's wait)
        self.writer = StorageWriter(self.rank, self.layout, tiers, link, self.device,
                                    stream=self.engine.stream, counters=self.counters,
                                    room_blocks=self.options.slab_blocks, generations=generations,
                                    quiet=QuietGate(quiet_s, sink=self.counters))
        self.peers.opened(desc)

    # ------------------------------------------------------------------ loads
    def save(self, rows: Sequence[Tuple[int, int, int]]) -> Optional[torch.cuda.Event]:
        """Copy the step's victims (published blocks vLLM hands out now) into Xavier's
        tier before the forward and the loads write them (the loads wait for the returned
        event); not behind the forward in flight, which writes none of them."""
        if not rows or self.writer is None or self.saves_dropped:
            return None
        self.writer.quiet.busy()  # (a hit's load may follow: :mod:`~..mechanism.quiet_gate`)
        with span(self.rank, "save", blocks=len(rows)):
            result = self.writer.export(self.engine_views, rows, after_forward=not self.unordered)
        if self.hooks is not None:
            self.hooks.exported(rows)
        return result.event

    def load(self, step: StepMeta, saved: Optional[torch.cuda.Event] = None) -> None:
        """Launch every load of ``step`` (vLLM's ``start_load_kv``); never waits for a copy
        (a CPU engine copies right away).  Failures become failed blocks for vLLM.  The
        copies wait for the step's victim saves (``saved``) only, not for the forward in
        flight (``GPUTransfer.load_gpu_requests_v1``'s ``ordered_after``), so
        :meth:`finished` can report them in the step that launched them."""
        if not step.has_loads:
            return
        if self.writer is not None:
            self.writer.quiet.busy()
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            after: Optional[List[torch.cuda.Event]] = None  # None: after the forward too
            if self.unordered:
                after = [] if saved is None else [saved]
            with span(self.rank, "load"):
                self._pending.append(self._load(step, after))
        finally:
            wall_us = int(1e6 * (time.perf_counter() - wall))
            self.counters.add("load_launch_us", wall_us)
            self.counters.add("load_launch_cpu_us", int(1e6 * (time.thread_time() - cpu)))
            if wall_us > self.counters.get("load_launch_max_us"):
                self.counters.set("load_launch_max_us", wall_us)

    def run_detached(self, step: StepMeta) -> Tuple[_StepLoad, Optional[str]]:
        """The test hooks' ``raw_load``: ``step``'s loads, never reported to vLLM."""
        pending = self._load(step, [] if self.unordered else None)
        return pending, pending.error

    def refuse(self, why: str) -> None:
        """Metadata that is not a valid load batch (it never becomes one): counted in
        ``rejected_metadata`` (its leases are the scheduler half's)."""
        self.counters.add("rejected_metadata")
        logger.warning("xavier: rank %d: malformed step metadata: %s", self.rank, why)

    def _load(self, step: StepMeta,
              ordered_after: Optional[Sequence[torch.cuda.Event]]) -> _StepLoad:
        step = step.for_shard(self.tp_rank, self.tp_size)
        batch: Optional[LoadBatch] = step.loads
        assert batch is not None
        pending = _StepLoad(batch.request_ids)
        pending.failed.update(step.failed_dests)  # not expressible as a load: recomputed
        if not self._attached or self.writer is None:
            self._fail(pending, batch.table[:, DEST].tolist(),
                       "not attached to the transfer actor")
            return pending
        if self.hooks is not None:
            self.hooks.before_load(batch)
        per_tier = np.bincount(batch.table[:, TIER], minlength=len(Tier)).tolist()
        self.counters.add("rows_from_gpu_tier", per_tier[Tier.GPU])
        self.counters.add("rows_from_cpu_tier", per_tier[Tier.CPU])
        self.counters.add("rows_from_vllm_cache", per_tier[Tier.VLLM])
        codes = np.unique(batch.table[:, RANK] * len(Tier) + batch.table[:, TIER]).tolist()
        pairs = [divmod(code, len(Tier)) for code in codes]
        unreachable = self.peers.ensure_mapped({r for r, _ in pairs})
        mapped = set(self.engine.mapped())
        unmapped = {(r, t) for r, t in pairs if r not in unreachable and (r, Tier(t)) not in mapped}
        if unreachable or unmapped:  # (a tier the peer published after it was mapped)
            drop = np.isin(batch.table[:, RANK], sorted(unreachable))
            for rank, tier in unmapped:
                drop |= (batch.table[:, RANK] == rank) & (batch.table[:, TIER] == tier)
                self.peers.refresh(rank)
            self.counters.add("rows_unreachable", int(drop.sum()))
            pending.failed.update(int(x) for x in batch.table[drop, DEST])
            batch = batch.without_rows(drop)
        if batch is not None and self.hooks is not None:
            batch = self.hooks.apply_faults(batch, pending.failed)
        if batch is None:
            return pending
        calls = [batch] if self.batched_loads else step.per_request(batch)
        for part in calls:
            try:
                pending.handles.append(self.engine.load_gpu_requests_v1(part, ordered_after))
            except Exception as exc:  # refused before any copy
                logger.warning("xavier: rank %d: load of %d blocks refused: %s", self.rank,
                               part.num_rows, exc)
                pending.error = f"{type(exc).__name__}: {exc}"
                pending.failed.update(int(x) for x in part.table[:, DEST])
        return pending

    def _fail(self, pending: _StepLoad, dests: Sequence[int], why: str) -> None:
        logger.warning("xavier: rank %d: step loads not done (%s): vLLM recomputes %d blocks",
                       self.rank, why, len(dests))
        pending.error = why
        pending.failed.update(dests)

    def finished(self, stream: Optional[torch.cuda.Stream] = None, idle: bool = False
                 ) -> Tuple[Set[str], Set[int]]:
        """Requests whose loads vLLM may now treat as done, and the blocks among them that
        were not written.  ``stream`` (vLLM's) is ordered after their copies first.  ``idle``
        (no forward in this step nor the one before): first waits, at most ``IDLE_WAIT_S``,
        until a load in flight is done (vLLM would run empty steps, on the cores it needs)."""
        done: Set[str] = set()
        failed: Set[int] = set()
        if self.hooks is not None and self.hooks.holding():
            return done, failed
        deadline = time.perf_counter() + (IDLE_WAIT_S if idle else REPORT_WAIT_S)
        if idle:
            waiting = [h for p in self._pending if not p.reportable() for h in p.handles]
            if waiting:
                self.counters.add("idle_wait_us", wait_for_any(waiting, deadline))
        self._wait_quick(deadline)
        still: List[_StepLoad] = []
        for p in self._pending:
            if not p.reportable():
                still.append(p)
                continue
            for h in p.handles:
                h.order(stream)
                failed.update(h.failed)
            failed.update(p.failed)
            done.update(p.request_ids)
            if self.report_waits and p.quick() and not p.late:
                self.counters.add("loads_reported_at_once")
        self._pending = still
        if failed and self.hooks is not None:
            self.hooks.loaded_failed(failed)
        return done, failed

    def _wait_quick(self, deadline: float) -> None:
        """Wait, until ``deadline`` at most, for quick loads not yet checked (just
        launched): one reported in this step's output is computed a step sooner."""
        waiting = [p for p in self._pending if p.quick() and not p.late and not p.reportable()]
        if not waiting or not self.report_waits:
            return
        self.counters.add("report_wait_us", wait_until_reportable(
            (h for p in waiting for h in p.handles), deadline))
        for p in waiting:
            if not p.reportable():
                p.late = True
                self.counters.add("report_wait_missed")

    def wait_pending(self, timeout: float = 60.0) -> bool:
        """Wait until every launched load can be reported (tests, shutdown)."""
        wait_until_reportable([h for p in self._pending for h in p.handles],
                              time.perf_counter() + timeout)
        return all(p.reportable() for p in self._pending)

    # ---------------------------------------------------------------- exports
    def export(self, rows: Sequence[Tuple[int, int, int]]) -> None:
        """Store the step's newly full blocks (vLLM's ``wait_for_save``); never waits."""
        if not rows or self.writer is None:
            return
        self.writer.export(self.engine_views, rows)
        if self.hooks is not None:
            self.hooks.exported(rows)

    def publish_in_place(self, rows: Sequence[Tuple[int, int, int, int]],
                         local: bool = False) -> None:
        """Register the step's newly full blocks ``(group, name, block, generation)`` as held
        in this engine's cache (``local``: host index only; no rows: ``local`` changed) once
        the forward that computed them completed (an event on vLLM's stream); never waits."""
        if self.writer is None or self.in_place is None:
            return
        event: Optional[torch.cuda.Event] = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.writer.publish_after([(g, k, int(Tier.VLLM), b, gen) for g, k, b, gen in rows],
                                  self.in_place.generations.incarnation, event, local)
        if self.hooks is not None:
            self.hooks.published_in_place(rows)

    def add_step_stats(self, stats: Dict[str, int]) -> None:
        """Add the step's figures to the counters; set its levels (:data:`GAUGE_NAMES`: a 0
        only for :data:`ZERO_LEVELS`, the others keep their last known value)."""
        for name, value in stats.items():
            if not value and name not in ZERO_LEVELS:
                continue  # (most of a step's figures: nothing to add, no level to keep)
            if name not in GAUGE_NAMES:
                self.counters.add(name, value)
            elif value >= 0:
                self.counters.set(name, value)

    # ------------------------------------------------------------------ close
    def flush(self, timeout: float = 30.0) -> None:
        """Wait for launched loads and pending publications (tests)."""
        self.wait_pending(timeout)
        self.engine.drain(timeout)
        if self.writer is not None:
            self.writer.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Let loads and exports in flight finish, unmap every storage (this process lets go
        of peers' CUDA IPC memory before they do), tell the transfer actor that the engine
        goes.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.peers.stop()  # no mapping made while the engine closes
        try:
            self.engine.close(timeout)
        except Exception as exc:
            logger.warning("xavier: rank %d: closing the load engine: %r", self.rank, exc)
        if self.writer is not None:
            self.writer.close(timeout)
            self.writer = None
        for release in self._own_releases:
            release()
        self._own_releases.clear()
        self.peers.close()
        if self.in_place is not None:  # peers' mappings keep what they mapped
            self.in_place.close()
        if self._shared_host is not None:
            self._shared_host.close()
        if self._attached:
            self._attached = False
            try:
                ref = self._transfer.get(timeout=5.0)
                if ref is not None:
                    pid = os.getpid()
                    self._bridge.call(lambda: ref.release_engine(pid), 5.0)
            except Exception as exc:
                logger.info("xavier: rank %d: telling the transfer actor: %r", self.rank, exc)
        self.counters.close()
