"""The batched load engine of one rank: ``GPUTransfer.load_gpu_requests_v1``.

Runs inside the vLLM worker process that owns the destination KV caches.  One call per
scheduler step carries every scheduled request's loads (a :class:`~.load_batch.LoadBatch`).
The call

1. plans the batch (:func:`~.plan.plan_step`: null blocks dropped, conflicts rejected,
   duplicates collapsed, reads grouped by source rank and tier, cut into slab-bounded
   transfers, slab size per peer with hysteresis);
2. validates the whole plan against the mapped storages and the local KV caches (groups,
   slot and block ranges) -- nothing is written when any of this fails
   (:class:`LoadRejected`, leases released before it raises);
3. launches the copies that read device memory on the engine's CUDA stream of its own,
   after the work already queued on the caller's stream (the blocks' previous users), and
   records an event; it does NOT wait for them (a CPU engine copies right away);
4. hands the rest to the completion thread: copies that read host memory on a CUDA
   engine (a CPU tier), copies from another host's storage (``map_remote_storage``);
5. the completion thread waits for the event and the background copies, then releases
   every lease -- on success and failure alike -- and completes the :class:`LoadHandle`.

A caller orders its own stream after the launched copies with :meth:`LoadHandle.order`
(the connector does so before vLLM may run a forward that reads the blocks), so the
engine's host thread never waits for a copy.  :meth:`GPUTransfer.close` is idempotent,
waits for loads in flight and refuses new loads and mappings.

Thread model: ``load_gpu_requests_v1``, the mapping methods and ``close`` are called by
the worker's step thread; the completion thread only touches what a launched load
captured.  Mappings are guarded by a lock all the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from ..planning.counters import Counters, CounterSink, TransferCounters
from ..planning.load_batch import Lease, LoadBatch, LoadBatchError, Tier
from ..planning.plan import (
    ConflictingWriteError,
    LoadPlan,
    SlabConfig,
    SlabState,
    Transfer,
    plan_step,
)
from . import block_copy_triton
from .block_copy import block_view, copy_transfer, slab_as
from .index_upload import IndexUploader
from .kv_schema import KVLayout, LayerTensors, layout_of
from .slabs import SlabPool

logger = logging.getLogger(__name__)


class TransferClosedError(RuntimeError):
    """The transfer engine is closed (or closing): no new loads or mappings."""


class LoadRejected(ValueError):
    """The batch was refused before any byte was written (the message says why)."""


class LoadError(RuntimeError):
    """A copy failed after it started; ``planned`` lists every destination of the
    batch (group -> block ids), some of which may be partly written."""

    def __init__(self, message: str, planned: Mapping[int, np.ndarray]) -> None:
        super().__init__(message)
        self.planned = planned


class CloseError(RuntimeError):
    """Some resources could not be released; ``close()`` may be called again."""


#: releases one lease (may raise: counted and reported, the other leases are still released)
ReleaseLease = Callable[[Lease], None]

#: Returns per-layer ``uint8`` staging rows ``[transfer.rows, block_bytes]`` (CPU) holding
#: the blocks ``transfer.src_slots`` of a storage that is not mapped into this process
#: (another host); runs on the completion thread.  See :mod:`.remote_fetch`.
RemoteFetch = Callable[[Transfer], List[torch.Tensor]]


@dataclass(frozen=True)
class LoadResult:
    request_ids: Tuple[str, ...]
    transfers: int
    blocks_written: int
    useful_bytes: int
    padded_bytes: int
    #: destinations planned: group -> sorted block ids
    written: Mapping[int, np.ndarray] = field(repr=False)
    #: destination block ids (all groups) that were NOT written: vLLM must recompute them
    failed: frozenset = frozenset()
    lease_release_errors: Tuple[str, ...] = ()


@dataclass
class _MappedStorage:
    rank: int
    tier: Tier
    layout: KVLayout
    layers: Dict[int, List[torch.Tensor]]  # block-first views
    release: Optional[Callable[[], None]]
    pointer_tables: Dict[int, torch.Tensor] = field(default_factory=dict)
    #: set for a remote storage (no local tensors): how to fetch its blocks
    fetch: Optional[RemoteFetch] = None


@dataclass
class _Job:
    """What the completion thread finishes for one launched load."""

    handle: LoadHandle
    plan: LoadPlan
    event: Optional[torch.cuda.Event]
    background: List[Tuple[Transfer, _MappedStorage]]
    leases: Sequence[Lease]
    launch_error: Optional[BaseException] = None


class LoadHandle:
    """One launched ``load_gpu_requests_v1``.

    * :attr:`reportable`: every destination is written (or known failed: :attr:`failed`) as
      far as the caller's stream is concerned once it called :meth:`order`: copies still
      running on the engine's stream are ordered before anything the caller queues next;
    * :meth:`wait`: everything finished and every lease released; the result, or the
      error of a load that failed after it started (:class:`LoadError`).
    """

    def __init__(self, request_ids: Tuple[str, ...], planned: Mapping[int, np.ndarray],
                 event: Optional[torch.cuda.Event], has_background: bool) -> None:
        self.request_ids = request_ids
        self.planned = planned
        self.event = event
        self._has_background = has_background
        self._background_done = threading.Event()
        self._done = threading.Event()
        self._result: Optional[LoadResult] = None
        self._error: Optional[BaseException] = None
        self.failed: Set[int] = set()

    @property
    def reportable(self) -> bool:
        return not self._has_background or self._background_done.is_set()

    def wait_reportable(self, timeout: Optional[float] = None) -> bool:
        return not self._has_background or self._background_done.wait(timeout)

    def order(self, stream: Optional[torch.cuda.Stream]) -> None:
        """Make ``stream`` wait for the launched copies (no host wait)."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> LoadResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"load of {len(self.request_ids)} requests not done after "
                               f"{timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class GPUTransfer:
    """Batched KV loads into one replica's KV caches (CPU or CUDA tensors)."""

    def __init__(self, rank: int, slab_config: Optional[SlabConfig] = None,
                 release_lease: Optional[ReleaseLease] = None,
                 copy_kernel: Optional[str] = None,
                 counters: Optional[CounterSink] = None) -> None:
        """``copy_kernel``: ``"auto"`` (default; env ``XAVIER_COPY_KERNEL``) uses the fused
        Triton gather-scatter for same-device CUDA transfers when it applies, ``"torch"``
        always uses the slab-staged torch copy, ``"triton"`` requires the fused kernel.
        ``counters``: where the figures go (default: in-process)."""
        kernel = copy_kernel or os.environ.get("XAVIER_COPY_KERNEL", "auto")
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"copy_kernel: expected auto, torch or triton, got {kernel!r}")
        self.copy_kernel = kernel
        self.rank = rank
        self.slab_config = slab_config or SlabConfig()
        self._release_lease = release_lease
        self.sink: CounterSink = counters if counters is not None else Counters()
        self._slab_state = SlabState()
        self._local_layout: Optional[KVLayout] = None
        self._local_layers: Dict[int, List[torch.Tensor]] = {}
        self._local_pointer_tables: Dict[int, torch.Tensor] = {}
        self._fused_cache: Dict[Tuple[int, Tier, int], bool] = {}
        self._indices = IndexUploader(torch.device("cpu"))
        self._local_release: Optional[Callable[[], None]] = None
        self._slabs: Optional[SlabPool] = None  # the step thread's
        self._bg_slabs: Optional[SlabPool] = None  # the completion thread's
        self._device: Optional[torch.device] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._storages: Dict[Tuple[int, Tier], _MappedStorage] = {}
        self._lock = threading.RLock()
        self._inflight: Set[LoadHandle] = set()
        self._jobs: queue.Queue[Optional[_Job]] = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ setup
    @property
    def counters(self) -> TransferCounters:
        return TransferCounters.of(self.sink)

    @property
    def local_layout(self) -> Optional[KVLayout]:
        return self._local_layout

    @property
    def closed(self) -> bool:
        return self._closed

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
        ``stream``: the CUDA stream to copy on (default: a new one)."""
        with self._lock:
            self._check_open("set_local_caches")
            layout = layout_of(caches, block_dim)
            if self._local_layout is not None and self._storages:
                for st in self._storages.values():
                    layout.check_compatible(st.layout, f"rank {st.rank} {st.tier.name} storage")
            devices = {_tensor(t).device for ts in caches.values() for t in ts}
            if len(devices) != 1:
                raise LoadBatchError(f"local KV caches: expected one device, got {devices}")
            self._device = devices.pop()
            self._local_layers = _block_views(caches, layout)
            self._local_pointer_tables = {}
            self._fused_cache.clear()
            self._indices = IndexUploader(self._device)
            self._local_layout = layout
            self._local_release = release
            self._slabs = SlabPool(layout, self.slab_config.full_rows,
                                   self.slab_config.small_rows, self._device)
            self._bg_slabs = SlabPool(layout, self.slab_config.full_rows,
                                      self.slab_config.small_rows, self._device)
            if self._device.type == "cuda":
                self._stream = stream or torch.cuda.Stream(device=self._device)
            if self._worker is None:
                self._worker = threading.Thread(target=self._complete_loop, daemon=True,
                                                name=f"xavier-load-completion-{self.rank}")
                self._worker.start()
            logger.info("rank %d: local KV caches registered: %d groups, fingerprint %s, "
                        "device %s", self.rank, len(layout.groups), layout.fingerprint(),
                        self._device)
            return layout

    def map_storage(self, rank: int, tier: Tier, caches: Mapping[int, LayerTensors],
                    block_dim: Union[int, Mapping[int, int]] = 0,
                    release: Optional[Callable[[], None]] = None) -> KVLayout:
        """Map the snapshot storage of ``rank``'s ``tier`` (tensors already opened,
        e.g. from CUDA IPC or shared memory).  Validated against the local layout;
        on mismatch nothing is mapped (and ``release`` is not called)."""
        layout = layout_of(caches, block_dim)
        self._install_storage(_MappedStorage(
            rank, Tier(tier), layout, _block_views(caches, layout), release), "map_storage")
        return layout

    def map_remote_storage(self, rank: int, tier: Tier, layout: KVLayout,
                           fetch: RemoteFetch,
                           release: Optional[Callable[[], None]] = None) -> None:
        """Map a storage of another host: its blocks arrive through ``fetch`` (on the
        completion thread) and are then written like local ones."""
        self._install_storage(
            _MappedStorage(rank, Tier(tier), layout, {}, release, fetch=fetch),
            "map_remote_storage")

    def _install_storage(self, st: _MappedStorage, what: str) -> None:
        """Validate ``st`` against the local layout and put it in place."""
        with self._lock:
            self._check_open(what)
            if self._local_layout is None:
                raise TransferClosedError(
                    f"{what}: local KV caches are not registered yet (set_local_caches)")
            self._local_layout.check_compatible(st.layout,
                                                f"rank {st.rank} {st.tier.name} storage")
            self._fused_cache.clear()
            old = self._storages.get((st.rank, st.tier))
            self._storages[(st.rank, st.tier)] = st
            if old is not None and old.release is not None:
                old.release()
            logger.info("rank %d: mapped %s rank %d %s storage (%s)", self.rank,
                        "remote" if st.fetch is not None else "local", st.rank, st.tier.name,
                        ", ".join(f"group {g.group}: {g.num_blocks} slots"
                                  for g in st.layout.groups))

    def unmap_storage(self, rank: int, tier: Optional[Tier] = None) -> int:
        """Drop the mappings of ``rank`` (one tier or all); returns how many.  Loads
        already launched keep what they captured until they finish."""
        with self._lock:
            keys = [k for k in self._storages if k[0] == rank and (tier is None or k[1] == tier)]
            self._fused_cache.clear()
            for k in keys:
                st = self._storages.pop(k)
                if st.release is not None:
                    st.release()
            return len(keys)

    def mapped(self) -> List[Tuple[int, Tier]]:
        with self._lock:
            return sorted(self._storages)

    # ------------------------------------------------------------------- load
    def load_gpu_requests_v1(self, batch: LoadBatch,
                             leases: Sequence[Lease] = ()) -> LoadHandle:
        """Launch every load of one step; see the module docstring for the contract.
        Raises (after releasing ``leases``) when the batch is refused before any copy."""
        with self._lock:
            try:
                self._check_open("load_gpu_requests_v1")
                plan = self._plan(batch)
                local, background = self._split(plan)
            except BaseException:
                self._release_all(leases)
                raise
            event: Optional[torch.cuda.Event] = None
            error: Optional[BaseException] = None
            try:
                event = self._launch(local)
            except BaseException as exc:  # some copies may be queued: the fence waits
                error = exc
                event = self._record_event()
            handle = LoadHandle(plan.request_ids, plan.written, event, bool(background))
            if error is not None:  # known now: reportable at once, so failed at once
                handle.failed = {int(b) for ids in plan.written.values() for b in ids}
            self._inflight.add(handle)
        self._jobs.put(_Job(handle, plan, event, background, leases, error))
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
        layout = self._local_layout
        if layout is None:
            raise LoadRejected("local KV caches are not registered (set_local_caches)")
        local_groups = set(layout.group_ids)
        for t in plan.transfers:
            if t.group not in local_groups:
                raise LoadRejected(f"group: KV-cache group {t.group} unknown locally "
                                   f"(groups {sorted(local_groups)})")
            st = self._storages.get((t.source_rank, t.tier))
            if st is None:
                raise LoadRejected(
                    f"rank: no storage mapped for rank {t.source_rank} tier {t.tier.name}")
            slots = st.layout.group(t.group).num_blocks
            if t.rows and int(t.src_slots.max()) >= slots:
                raise LoadRejected(
                    f"slot: {int(t.src_slots.max())} out of range [0, {slots}) for rank "
                    f"{t.source_rank} {t.tier.name} storage, group {t.group}")
            blocks = layout.group(t.group).num_blocks
            if len(t.dst_blocks) and int(t.dst_blocks.max()) >= blocks:
                raise LoadRejected(
                    f"dest: block id {int(t.dst_blocks.max())} out of range [0, {blocks}) "
                    f"for KV-cache group {t.group}")
            self._fused_ok(st, t.group)  # copy_kernel="triton" refuses here, before any copy

    def _split(self, plan: LoadPlan) -> Tuple[List[Tuple[Transfer, _MappedStorage]],
                                              List[Tuple[Transfer, _MappedStorage]]]:
        """Transfers launched now (device memory, or any copy of a CPU engine) and those
        the completion thread runs (host memory into a CUDA engine; other hosts)."""
        local: List[Tuple[Transfer, _MappedStorage]] = []
        background: List[Tuple[Transfer, _MappedStorage]] = []
        for t in plan.transfers:
            st = self._storages[(t.source_rank, t.tier)]
            on_host = st.fetch is not None or (
                self._device is not None and self._device.type == "cuda"
                and st.layers[t.group][0].device.type != "cuda")
            (background if on_host else local).append((t, st))
        return local, background

    def _record_event(self) -> Optional[torch.cuda.Event]:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _launch(self, jobs: Sequence[Tuple[Transfer, _MappedStorage]]
                ) -> Optional[torch.cuda.Event]:
        """Queue the copies of ``jobs`` on the engine's stream (after the caller's stream's
        work) and return the event that marks their end; on a CPU engine copy now."""
        if not jobs:
            return None
        assert self._slabs is not None and self._device is not None
        fused = [self._fused_ok(st, t.group) for t, st in jobs]
        arrays: List[np.ndarray] = []
        for (t, _), f in zip(jobs, fused):
            if f:
                arrays += [t.src_slots[t.dst_rows], t.dst_blocks]
            else:
                arrays += [t.src_slots, t.dst_blocks, t.dst_rows]
        if self._stream is None:  # CPU: copies happen here and now
            self._run(jobs, fused, self._indices.upload(arrays), self._slabs)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            self._run(jobs, fused, self._indices.upload(arrays), self._slabs)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def _run(self, jobs: Sequence[Tuple[Transfer, _MappedStorage]], fused: Sequence[bool],
             indices: List[torch.Tensor], slabs: SlabPool) -> None:
        it = iter(indices)
        for (t, st), f in zip(jobs, fused):
            if f:
                self._run_fused(st, t, next(it), next(it))
                continue
            src_slots, dst_blocks, dst_rows = next(it), next(it), next(it)
            src = st.layers[t.group]
            copy_transfer(src, self._local_layers[t.group], slabs.get(t.group, t.slab_rows),
                          src_slots.to(src[0].device), dst_blocks, dst_rows, t.identity_rows)

    # ------------------------------------------------------------ completion
    def _complete_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._complete(job)
            except BaseException as exc:  # never let the thread die: the handle fails
                logger.exception("rank %d: completing a load failed", self.rank)
                job.handle._error = exc
                job.handle._background_done.set()
                job.handle._done.set()

    def _complete(self, job: _Job) -> None:
        handle, plan = job.handle, job.plan
        failed: Set[int] = set()
        error = job.launch_error
        try:
            if job.event is not None:
                job.event.synchronize()
        except BaseException as exc:  # a device fault: nothing of this load is trusted
            error = error or exc
        if error is None:
            for t, st in job.background:
                try:
                    self._run_background(t, st)
                except BaseException as exc:  # this transfer's blocks are recomputed
                    logger.warning("rank %d: load of %d blocks from rank %d %s failed: %r",
                                   self.rank, len(t.dst_blocks), t.source_rank, t.tier.name,
                                   exc)
                    failed.update(int(b) for b in t.dst_blocks)
        handle.failed = failed if error is None else {
            int(b) for ids in plan.written.values() for b in ids}
        handle._background_done.set()
        errors = self._release_all(job.leases)
        layout = self._local_layout
        sink = self.sink
        if error is not None:
            sink.add("load_failures")
            logger.error("rank %d: load of %d requests failed during copy: %r", self.rank,
                         len(plan.request_ids), error)
            handle._error = LoadError(f"copy failed: {error!r}", plan.written)
        else:
            ok = [t for t in plan.transfers if not set(t.dst_blocks.tolist()) & failed]
            block_bytes = {g.group: g.block_bytes for g in layout.groups} if layout else {}
            if failed:
                sink.add("load_failures")
            sink.add("batch_calls")
            sink.add("logical_requests", len(plan.request_ids))
            sink.add("transfers", len(plan.transfers))
            sink.add("useful_bytes", sum(t.rows * block_bytes.get(t.group, 0) for t in ok))
            sink.add("padded_bytes", sum(t.padded_rows * block_bytes.get(t.group, 0)
                                         for t in plan.transfers))
            written = plan.blocks_written - len(failed)
            sink.add("blocks_written", written)
            handle._result = LoadResult(
                plan.request_ids, len(plan.transfers), written,
                sum(t.rows * block_bytes.get(t.group, 0) for t in ok),
                sum(t.padded_rows * block_bytes.get(t.group, 0) for t in plan.transfers),
                plan.written, frozenset(failed), tuple(errors))
        with self._lock:
            self._inflight.discard(handle)
        handle._done.set()

    def _run_background(self, t: Transfer, st: _MappedStorage) -> None:
        """On the completion thread: a transfer from host memory (a CPU tier) into a CUDA
        engine, or from another host; returns when its writes are complete."""
        dst = self._local_layers[t.group]
        if st.fetch is not None:
            staging = st.fetch(t)
            self._write_staged(t, staging)
            return
        assert self._bg_slabs is not None and self._device is not None
        with self._on_stream():
            dev = self._device
            copy_transfer(st.layers[t.group], dst, self._bg_slabs.get(t.group, t.slab_rows),
                          torch.from_numpy(t.src_slots), torch.from_numpy(t.dst_blocks).to(dev),
                          torch.from_numpy(t.dst_rows).to(dev), t.identity_rows)
            event = self._record_event()
        if event is not None:
            event.synchronize()
        self.sink.add("loads_in_background")

    def _write_staged(self, t: Transfer, staging: Sequence[torch.Tensor]) -> None:
        device = self._device
        assert device is not None
        with self._on_stream():
            dst_blocks = torch.from_numpy(t.dst_blocks).to(device)
            for s, d in zip(staging, self._local_layers[t.group]):
                values = slab_as(s, t.rows, d)
                if not t.identity_rows:
                    values = values.index_select(0, torch.from_numpy(t.dst_rows))
                d.index_copy_(0, dst_blocks, values.to(device, non_blocking=True))
            event = self._record_event()
        if event is not None:
            event.synchronize()
        self.sink.add("loads_in_background")

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's stream as the current one (nothing on CPU)."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _fused_ok(self, st: _MappedStorage, group: int) -> bool:
        key = (st.rank, st.tier, group)
        ok = self._fused_cache.get(key)
        if ok is None:
            ok = st.fetch is None and self.copy_kernel != "torch" and block_copy_triton.supports(
                st.layers[group], self._local_layers[group])
            self._fused_cache[key] = ok
        if not ok and self.copy_kernel == "triton":
            raise LoadRejected("copy_kernel: the fused Triton kernel does not apply to rank "
                               f"{st.rank} {st.tier.name} group {group} (needs contiguous "
                               "block-first CUDA layers)")
        return ok

    def _run_fused(self, st: _MappedStorage, t: Transfer, src_idx: torch.Tensor,
                   dst_idx: torch.Tensor) -> None:
        src, dst = st.layers[t.group], self._local_layers[t.group]
        src_table = st.pointer_tables.get(t.group)
        if src_table is None:
            src_table = st.pointer_tables[t.group] = block_copy_triton.pointer_table(src)
        dst_table = self._local_pointer_tables.get(t.group)
        if dst_table is None:
            dst_table = self._local_pointer_tables[t.group] = block_copy_triton.pointer_table(dst)
        block_copy_triton.gather_scatter(
            src_table, dst_table, len(dst), int(dst[0].shape[1]), src[0].stride(0),
            dst[0].stride(0), src_idx, dst_idx)
        self.sink.add("fused_transfers")

    def _release_all(self, leases: Sequence[Lease]) -> List[str]:
        errors: List[str] = []
        if not leases or self._release_lease is None:
            return errors
        for lease in leases:
            try:
                self._release_lease(lease)
            except Exception as exc:
                self.sink.add("lease_release_failures")
                errors.append(f"lease {lease.lease_id} on rank {lease.rank}: {exc!r}")
        if errors:
            logger.error("rank %d: %d of %d lease releases failed: %s", self.rank, len(errors),
                         len(leases), "; ".join(errors))
        return errors

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
            if self._worker is not None:
                self._jobs.put(None)
                self._worker.join(timeout=30)
                self._worker = None
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
            self._local_pointer_tables.clear()
            self._indices.close()
            self._stream = None
            self._closed = True
            logger.info("rank %d: transfer engine closed", self.rank)


def _tensor(item: object) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item  # type: ignore[return-value,index]


def _block_views(caches: Mapping[int, LayerTensors],
                 layout: KVLayout) -> Dict[int, List[torch.Tensor]]:
    views: Dict[int, List[torch.Tensor]] = {}
    for g in layout.groups:
        views[g.group] = [block_view(_tensor(item), la.block_dim)
                          for item, la in zip(caches[g.group], g.layers)]
    return views
