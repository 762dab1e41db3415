"""The batched load engine of one rank: ``GPUTransfer.load_gpu_requests_v1``.

Runs inside the vLLM worker process that owns the destination KV caches.  One call per
scheduler step carries every scheduled request's loads (a
:class:`~..planning.load_batch.LoadBatch`).  The call

1. plans the batch (:func:`~..planning.plan.plan_step`: null blocks dropped, conflicts rejected,
   duplicates collapsed, reads grouped by source rank and tier, cut into slab-bounded
   transfers, slab size per peer with hysteresis);
2. validates the whole plan against the mapped storages and the local KV caches (groups,
   slot and block ranges) -- nothing is written when any of this fails
   (:class:`LoadRejected`);
3. launches the copies that read device memory on the engine's high-priority CUDA stream,
   after the work already queued on the caller's stream (the blocks' previous users) --
   or, given ``ordered_after`` events, after those only: the caller vouches that nothing
   queued on its stream touches the destinations, which vLLM guarantees for an
   asynchronous load's blocks (it defers freeing a block a step in flight may write, for a
   KV consumer with batches in flight, ``defer_block_free``, and never zeroes them), so a
   worker names its victim saves only -- and records an event (the load is
   :attr:`~.load_handle.LoadHandle.quick` when nothing of it runs on the completion thread); it does
   NOT wait for them (a CPU engine copies right away);
4. hands the rest to the completion thread (other hosts; host memory without a CUDA view,
   :mod:`.uva`), which starts them after the event (one is recorded for them too);
5. the completion thread waits for the event and the background copies, checks every
   read against what its source holds now (:mod:`.read_checks`: a failed block if not),
   and completes the :class:`LoadHandle`; a load that read anything is reportable only
   then (the scheduler half releases its leases once vLLM reports it done).

A caller orders its stream after the copies with :meth:`LoadHandle.order` (before vLLM
may run a forward that reads the blocks): the host never waits for a copy.
:meth:`GPUTransfer.close` is idempotent, waits for loads in flight, refuses new work.

Thread model: the step thread calls ``load_gpu_requests_v1``, the mapping methods and
``close``; the completion thread touches only what a load captured; mappings take a lock
(the peer-mapping thread maps too).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from ..planning.counters import Counters, CounterSink, TransferCounters
from ..planning.load_batch import LoadBatch, LoadBatchError, Tier
from ..planning.log_names import package_logger
from ..planning.plan import (
    ConflictingWriteError,
    LoadPlan,
    SlabConfig,
    SlabState,
    Transfer,
    plan_step,
)
from ..planning.trace_spans import span
from .block_copy import block_views, copy_transfer, layer_tensor
from .fused_loads import FusedLoads
from .index_upload import IndexUploader
from .kv_schema import KVLayout, LayerTensors, layout_of
from .load_checks import check_plan
from .load_completion import EngineParts, LoadCompletion, record_event
from .load_handle import (
    CloseError,
    LoadHandle,
    LoadJob,
    LoadRejected,
    MappedStorage,
    RemoteFetch,
    TransferClosedError,
)
from .slabs import SlabPool
from .uva import cuda_views

logger = package_logger(__name__)


class GPUTransfer:
    """Batched KV loads into one replica's KV caches (CPU or CUDA tensors)."""

    def __init__(self, rank: int, slab_config: Optional[SlabConfig] = None,
                 copy_kernel: Optional[str] = None,
                 counters: Optional[CounterSink] = None, validate_reads: bool = True) -> None:
        """``copy_kernel``: ``"auto"`` (default; env ``XAVIER_COPY_KERNEL``) uses the fused
        Triton gather-scatter for same-device CUDA transfers when it applies, ``"torch"``
        always uses the slab-staged torch copy, ``"triton"`` requires the fused kernel.
        ``counters``: where the figures go (default: in-process).  ``validate_reads``:
        off only as a test's negative control (:mod:`.read_checks`)."""
        kernel = copy_kernel or os.environ.get("XAVIER_COPY_KERNEL", "auto")
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"copy_kernel: expected auto, torch or triton, got {kernel!r}")
        self.copy_kernel = kernel
        self.rank = rank
        self.slab_config = slab_config or SlabConfig()
        self.sink: CounterSink = counters if counters is not None else Counters()
        self._completion = LoadCompletion(rank, self.sink, self._finished, validate_reads)
        self._slab_state = SlabState()
        self._local_layout: Optional[KVLayout] = None
        self._local_layers: Dict[int, List[torch.Tensor]] = {}
        self._fused = FusedLoads(kernel, self.sink)
        self._indices = IndexUploader(torch.device("cpu"))
        self._local_release: Optional[Callable[[], None]] = None
        self._slabs: Optional[SlabPool] = None  # the step thread's
        self._bg_slabs: Optional[SlabPool] = None  # the completion thread's
        self._device: Optional[torch.device] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._storages: Dict[Tuple[int, Tier], MappedStorage] = {}
        self._lock = threading.RLock()
        self._inflight: Set[LoadHandle] = set()
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ setup
    @property
    def counters(self) -> TransferCounters:
        return TransferCounters.of(self.sink)

    @property
    def local_layout(self) -> Optional[KVLayout]:
        return self._local_layout

    closed = property(lambda self: self._closed)

    @property
    def device(self) -> Optional[torch.device]:
        return self._device

    @property
    def stream(self) -> Optional[torch.cuda.Stream]:
        """The engine's own CUDA stream (None on CPU)."""
        return self._stream

    @property
    def local_block_views(self) -> Dict[int, List[torch.Tensor]]:
        """Block-first views of the local KV caches per group (empty before
        :meth:`set_local_caches`)."""
        return self._local_layers

    def set_local_caches(self, caches: Mapping[int, LayerTensors],
                         block_dim: Union[int, Mapping[int, int]] = 0,
                         release: Optional[Callable[[], None]] = None,
                         stream: Optional[torch.cuda.Stream] = None) -> KVLayout:
        """Register this replica's KV caches (the destinations of every load).
        ``stream``: the CUDA stream to copy on (default: a new one).  A second call replaces
        them: loads in flight finish first, the previous ``release`` is called (once)."""
        self.drain()  # loads in flight finish writing into the caches they were given
        with self._lock:
            self._check_open("set_local_caches")
            layout = layout_of(caches, block_dim)
            if self._local_layout is not None and self._storages:
                for st in self._storages.values():
                    layout.check_compatible(st.layout, f"rank {st.rank} {st.tier.name} storage")
            devices = {layer_tensor(t).device for ts in caches.values() for t in ts}
            if len(devices) != 1:
                raise LoadBatchError(f"local KV caches: expected one device, got {devices}")
            if self._local_release is not None:  # replaced caches are let go, like storages
                self._local_release()
                self._local_release = None
            for pool in (self._slabs, self._bg_slabs):
                if pool is not None:
                    pool.close()
            self._device = devices.pop()
            self._local_layers = block_views(caches, layout)
            self._fused.forget(local_caches=True)
            self._indices = IndexUploader(self._device)
            self._local_layout = layout
            self._local_release = release
            self._slabs = SlabPool(layout, self.slab_config.full_rows,
                                   self.slab_config.small_rows, self._device)
            self._bg_slabs = SlabPool(layout, self.slab_config.full_rows,
                                      self.slab_config.small_rows, self._device)
            if self._device.type == "cuda":
                # high priority: a load's copies are short, and the request waits on them
                # (CUDA maps -1 to its highest priority)
                self._stream = stream or torch.cuda.Stream(device=self._device, priority=-1)
            self._completion.start(EngineParts(self._local_layers, layout, self._device,
                                               self._stream, self._bg_slabs))
            logger.info("rank %d: local KV caches registered: %d groups, fingerprint %s, "
                        "device %s", self.rank, len(layout.groups), layout.fingerprint(),
                        self._device)
            return layout

    def map_storage(self, rank: int, tier: Tier, caches: Mapping[int, LayerTensors],
                    block_dim: Union[int, Mapping[int, int]] = 0,
                    release: Optional[Callable[[], None]] = None,
                    generations: Optional[Any] = None) -> KVLayout:
        """Map the snapshot storage of ``rank``'s ``tier`` (tensors already opened,
        e.g. from CUDA IPC or shared memory) and its ``generations``
        (:class:`~.slot_generations.SlotGenerations`, mapped by the caller: every read is
        checked against it; without, reads are not checked).  Validated against the local
        layout; on mismatch nothing is mapped (and ``release`` is not called).  A page-locked host
        tier of a CUDA engine is read through CUDA views (:mod:`.uva`): its copies are
        launched with the step's GPU copies instead of on the completion thread."""
        layout = layout_of(caches, block_dim)
        views = cuda_views(caches, self._device)
        if views is not None:
            self.sink.add("uva_storages_mapped")
        self._install_storage(MappedStorage(
            rank, Tier(tier), layout, block_views(views or caches, layout), release,
            host_layers={g: [layer_tensor(x) for x in ts] for g, ts in caches.items()}
            if views else None, generations=generations),
            "map_storage")
        return layout

    def map_remote_storage(self, rank: int, tier: Tier, layout: KVLayout,
                           fetch: RemoteFetch,
                           release: Optional[Callable[[], None]] = None) -> None:
        """Map a storage of another host: its blocks arrive through ``fetch`` (on the
        completion thread) and are then written like local ones."""
        self._install_storage(
            MappedStorage(rank, Tier(tier), layout, {}, release, fetch=fetch),
            "map_remote_storage")

    def _install_storage(self, st: MappedStorage, what: str) -> None:
        """Validate ``st`` against the local layout and put it in place."""
        with self._lock:
            self._check_open(what)
            if self._local_layout is None:
                raise TransferClosedError(
                    f"{what}: local KV caches are not registered yet (set_local_caches)")
            self._local_layout.check_compatible(st.layout,
                                                f"rank {st.rank} {st.tier.name} storage")
            self._fused.forget()
            old = self._storages.get((st.rank, st.tier))
            self._storages[(st.rank, st.tier)] = st
            logger.info("rank %d: mapped %s rank %d %s storage (%s)", self.rank,
                        "remote" if st.fetch is not None else "local", st.rank, st.tier.name,
                        ", ".join(f"group {g.group}: {g.num_blocks} slots"
                                  for g in st.layout.groups))
        if old is not None:  # outside the lock: letting go may wait for loads in flight
            self._let_go([old])

    def unmap_storage(self, rank: int, tier: Optional[Tier] = None) -> int:
        """Drop the mappings of ``rank`` (one tier or all); returns how many.  Loads
        already launched keep what they captured until they finish."""
        with self._lock:
            keys = [k for k in self._storages if k[0] == rank and (tier is None or k[1] == tier)]
            self._fused.forget()
            gone = [self._storages.pop(k) for k in keys]
        self._let_go(gone)
        return len(keys)

    def _let_go(self, storages: Sequence[MappedStorage]) -> None:
        """Release unmapped ``storages`` (never under the lock: the completion thread takes
        it).  A page-locked host tier read through CUDA views is unregistered by its release
        while a kernel may still read it: loads in flight finish first (rare, one step)."""
        if any(st.host_layers is not None for st in storages):
            self.drain()
        for st in storages:
            if st.release is not None:
                st.release()

    def take_stale_ranks(self) -> Set[int]:
        """Ranks still mapped as a storage a load found gone: to be mapped again."""
        stale = self._completion.take_stale()
        with self._lock:
            return {st.rank for st in stale if self._storages.get((st.rank, st.tier)) is st}

    def mapped(self) -> List[Tuple[int, Tier]]:
        with self._lock:
            return sorted(self._storages)

    # ------------------------------------------------------------------- load
    def load_gpu_requests_v1(self, batch: LoadBatch,
                             ordered_after: Optional[Sequence[torch.cuda.Event]] = None
                             ) -> LoadHandle:
        """Launch every load of one step; see the module docstring for the contract
        (``ordered_after``: step 3).  Raises when the batch is refused before any copy."""
        with self._lock, span(self.rank, "load.locked", rows=batch.num_rows):
            self._check_open("load_gpu_requests_v1")
            with span(self.rank, "load.plan"):
                plan = self._plan(batch)
                local, background = self._split(plan)
            event: Optional[torch.cuda.Event] = None
            error: Optional[BaseException] = None
            try:
                with span(self.rank, "load.launch", blocks=plan.blocks_written):
                    event = self._launch(local, ordered_after)
                if event is None and background and self._stream is not None:  # after e.g.
                    # a victim saved out of a destination block (the completion thread waits)
                    self._order_stream(ordered_after)
                    event = record_event(self._stream)
            except BaseException as exc:  # some copies may be queued: the fence waits
                error = exc
                event = record_event(self._stream)
            reads = local + background
            # reportable only after the completion thread, whenever anything was read: its
            # copies are then complete on the host (the leases' release waits for that); a
            # launch that failed is reportable at once, every destination failed (vLLM's
            # stream still waits for the copies queued before the failure: the fence)
            handle = LoadHandle(plan.request_ids, plan.written, event,
                                bool(reads) and error is None,
                                quick=not background and error is None)
            if error is not None:  # known now: reportable at once, so failed at once
                handle.failed = {int(b) for ids in plan.written.values() for b in ids}
            self._inflight.add(handle)
        self._completion.submit(LoadJob(handle, plan, event, background, error, reads))
        return handle

    def _plan(self, batch: LoadBatch) -> LoadPlan:
        try:
            if not isinstance(batch, LoadBatch):
                raise LoadBatchError(
                    f"batch: expected LoadBatch, got {type(batch).__name__}")
            plan, next_state = plan_step(batch, self.slab_config, self._slab_state)
            self._validate(plan)
        except (LoadBatchError, ConflictingWriteError, LoadRejected) as exc:
            self.sink.add("rejected_batches")
            logger.warning("rank %d: load batch rejected before any copy: %s", self.rank, exc)
            raise
        self._slab_state = next_state
        return plan

    def _validate(self, plan: LoadPlan) -> None:
        if self._local_layout is None:
            raise LoadRejected("local KV caches are not registered (set_local_caches)")
        for st, group in check_plan(plan, self._local_layout, self._storages):
            # copy_kernel="triton" refuses here, before any copy
            self._fused.applies(st, group, self._local_layers[group])

    def _split(self, plan: LoadPlan) -> Tuple[List[Tuple[Transfer, MappedStorage]],
                                              List[Tuple[Transfer, MappedStorage]]]:
        """Transfers launched now (device memory, or any copy of a CPU engine) and those
        the completion thread runs (host memory into a CUDA engine; other hosts)."""
        local: List[Tuple[Transfer, MappedStorage]] = []
        background: List[Tuple[Transfer, MappedStorage]] = []
        for t in plan.transfers:
            st = self._storages[(t.source_rank, t.tier)]
            on_host = st.fetch is not None or (
                self._device is not None and self._device.type == "cuda"
                and st.layers[t.group][0].device.type != "cuda")
            (background if on_host else local).append((t, st))
        return local, background

    def _order_stream(self, ordered_after: Optional[Sequence[torch.cuda.Event]]) -> None:
        """After the caller's stream, or ``ordered_after`` only (module docstring, 3)."""
        assert self._stream is not None
        if ordered_after is None:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            return
        for event in ordered_after:
            self._stream.wait_event(event)

    def _launch(self, jobs: Sequence[Tuple[Transfer, MappedStorage]],
                ordered_after: Optional[Sequence[torch.cuda.Event]] = None
                ) -> Optional[torch.cuda.Event]:
        """Queue the copies of ``jobs`` on the engine's stream (:meth:`_order_stream`) and
        return the event that marks their end; on a CPU engine copy now."""
        if not jobs:
            return None
        assert self._slabs is not None and self._device is not None
        fused = [self._fused.applies(st, t.group, self._local_layers[t.group])
                 for t, st in jobs]
        arrays: List[np.ndarray] = []
        for (t, _), f in zip(jobs, fused):
            if f:
                arrays += [t.src_slots[t.dst_rows], t.dst_blocks]
            else:
                arrays += [t.src_slots, t.dst_blocks, t.dst_rows]
        if self._stream is None:  # CPU: copies happen here and now
            self._run(jobs, fused, self._indices.upload(arrays), self._slabs)
            return None
        self._order_stream(ordered_after)
        with torch.cuda.stream(self._stream):
            self._run(jobs, fused, self._indices.upload(arrays), self._slabs)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def _run(self, jobs: Sequence[Tuple[Transfer, MappedStorage]], fused: Sequence[bool],
             indices: List[torch.Tensor], slabs: SlabPool) -> None:
        it = iter(indices)
        for (t, st), f in zip(jobs, fused):
            if f:
                self._fused.run(st, t, self._local_layers[t.group], next(it), next(it))
                continue
            src_slots, dst_blocks, dst_rows = next(it), next(it), next(it)
            src = st.layers[t.group]
            copy_transfer(src, self._local_layers[t.group], slabs.get(t.group, t.slab_rows),
                          src_slots.to(src[0].device), dst_blocks, dst_rows, t.identity_rows)

    def _finished(self, handle: LoadHandle) -> None:
        """The completion thread is done with ``handle`` (called before it completes)."""
        with self._lock:
            self._inflight.discard(handle)

    # ------------------------------------------------------------------ close
    def _check_open(self, what: str) -> None:
        if self._closing or self._closed:
            raise TransferClosedError(f"{what}: the transfer engine of rank {self.rank} is closed")

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every launched load is done (leases released)."""
        with self._lock:
            pending = list(self._inflight)
        for h in pending:
            if not h._done.wait(timeout):
                return False
        return True

    def close(self, timeout: Optional[float] = 300.0) -> None:
        """Release slabs, mapped storages and local cache references.

        Idempotent.  Waits for loads in flight (their copies and lease releases).  If
        some release fails, the rest is still released, :class:`CloseError` is raised
        and a later ``close()`` retries only what is left.
        """
        if self._closed:
            return
        self._closing = True
        if not self.drain(timeout):
            logger.error("rank %d: close: loads still in flight after %s s", self.rank, timeout)
        with self._lock:
            self._completion.stop()
            errors: List[str] = []
            if self._slabs is not None:
                self._slabs.close()
            if self._bg_slabs is not None:
                self._bg_slabs.close()
            for key in list(self._storages):
                st = self._storages[key]
                try:
                    if st.release is not None:
                        st.release()
                except Exception as exc:  # keep it for the retry
                    errors.append(f"rank {st.rank} {st.tier.name} storage: {exc!r}")
                    continue
                del self._storages[key]
            if self._local_release is not None:
                try:
                    self._local_release()
                    self._local_release = None
                except Exception as exc:
                    errors.append(f"local KV caches: {exc!r}")
            if errors:
                logger.error("rank %d: close incomplete: %s", self.rank, "; ".join(errors))
                raise CloseError("close incomplete, call close() again: " + "; ".join(errors))
            self._local_layers.clear()
            self._fused.forget(local_caches=True)
            self._indices.close()
            self._stream = None
            self._closed = True
            logger.info("rank %d: transfer engine closed", self.rank)
