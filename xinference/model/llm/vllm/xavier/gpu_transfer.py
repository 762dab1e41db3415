"""The batched load engine of one rank: ``GPUTransfer.load_gpu_requests_v1``.

One call per scheduler step carries every scheduled request's loads (a
:class:`~.load_batch.LoadBatch`).  The call

1. plans the batch (:func:`~.plan.plan_step`: null blocks dropped, conflicts
   rejected, duplicates collapsed, reads grouped by source rank and tier, cut
   into slab-bounded transfers, slab size per peer with hysteresis);
2. validates the whole plan against the mapped storages and the local KV
   caches (groups, slot and block ranges) -- nothing is written when any of
   this fails (:class:`LoadRejected`);
3. executes the transfers in a worker thread (CUDA: on a dedicated stream,
   synchronized before returning: the writes are fenced);
4. releases every lease after the writes have finished, on success, failure
   and cancellation alike; a lease whose release raises does not stop the
   others and is reported in :class:`LoadResult` / the counters.

A cancelled caller still waits for the copy to finish (repeated
cancellations too), then sees ``CancelledError``.

Storages of peers (and of this rank's own tiers) are mapped with
:meth:`GPUTransfer.map_storage` under one asyncio lock, after schema
validation against the local KV layout.  :meth:`GPUTransfer.close` is
idempotent and retryable; afterwards loads and mappings are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from . import block_copy_triton
from .block_copy import block_view, copy_transfer, slab_as
from .counters import TransferCounters
from .index_upload import IndexUploader
from .kv_schema import KVLayout, LayerTensors, layout_of
from .load_batch import LoadBatch, LoadBatchError, Tier
from .plan import ConflictingWriteError, LoadPlan, SlabConfig, SlabState, Transfer, plan_step
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


@dataclass(frozen=True)
class Lease:
    """A hold on a source slot, taken at query time, released after the writes."""

    lease_id: int
    rank: int


ReleaseLease = Callable[[Lease], Awaitable[None]]

#: Fills per-layer ``uint8`` staging rows ``[transfer.rows, block_bytes]`` with the blocks
#: ``transfer.src_slots`` of a storage that is not mapped into this process (another host):
#: see :mod:`.remote_fetch`.
RemoteFetch = Callable[["Transfer", List[torch.Tensor]], Awaitable[None]]


@dataclass(frozen=True)
class LoadResult:
    request_ids: Tuple[str, ...]
    transfers: int
    blocks_written: int
    useful_bytes: int
    padded_bytes: int
    #: destinations written: group -> sorted block ids
    written: Mapping[int, np.ndarray] = field(repr=False)
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


class GPUTransfer:
    """Batched KV loads into one replica's KV caches (CPU or CUDA tensors)."""

    def __init__(self, rank: int, slab_config: Optional[SlabConfig] = None,
                 release_lease: Optional[ReleaseLease] = None,
                 copy_kernel: Optional[str] = None) -> None:
        """``copy_kernel``: ``"auto"`` (default; env ``XAVIER_COPY_KERNEL``) uses the fused
        Triton gather-scatter for same-device CUDA transfers when it applies, ``"torch"``
        always uses the slab-staged torch copy, ``"triton"`` requires the fused kernel."""
        kernel = copy_kernel or os.environ.get("XAVIER_COPY_KERNEL", "auto")
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"copy_kernel: expected auto, torch or triton, got {kernel!r}")
        self.copy_kernel = kernel
        self.rank = rank
        self.slab_config = slab_config or SlabConfig()
        self._release_lease = release_lease
        self.counters = TransferCounters()
        self._slab_state = SlabState()
        self._local_layout: Optional[KVLayout] = None
        self._local_layers: Dict[int, List[torch.Tensor]] = {}
        self._local_pointer_tables: Dict[int, torch.Tensor] = {}
        self._fused_cache: Dict[Tuple[int, Tier, int], bool] = {}
        self._staging: Dict[int, List[torch.Tensor]] = {}  # remote fetches, per group
        self._indices = IndexUploader(torch.device("cpu"))
        self._local_release: Optional[Callable[[], None]] = None
        self._slabs: Optional[SlabPool] = None
        self._device: Optional[torch.device] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._storages: Dict[Tuple[int, Tier], _MappedStorage] = {}
        self._mapping_lock = asyncio.Lock()
        self._copy_lock = asyncio.Lock()
        self._inflight: Set[asyncio.Future] = set()
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ setup
    @property
    def local_layout(self) -> Optional[KVLayout]:
        return self._local_layout

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def local_block_views(self) -> Dict[int, List[torch.Tensor]]:
        """Block-first views of the local KV caches per group (empty before
        :meth:`set_local_caches`): what exports read from."""
        return self._local_layers

    async def set_local_caches(self, caches: Mapping[int, LayerTensors],
                               block_dim: Union[int, Mapping[int, int]] = 0,
                               release: Optional[Callable[[], None]] = None) -> KVLayout:
        """Register this replica's KV caches (the destinations of every load)."""
        async with self._mapping_lock:
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
            if self._device.type == "cuda":
                self._stream = torch.cuda.Stream(device=self._device)
            logger.info("rank %d: local KV caches registered: %d groups, fingerprint %s, "
                        "device %s", self.rank, len(layout.groups), layout.fingerprint(),
                        self._device)
            return layout

    async def map_storage(self, rank: int, tier: Tier, caches: Mapping[int, LayerTensors],
                          block_dim: Union[int, Mapping[int, int]] = 0,
                          release: Optional[Callable[[], None]] = None) -> KVLayout:
        """Map the snapshot storage of ``rank``'s ``tier`` (tensors already opened,
        e.g. from CUDA IPC or shared memory).  Validated against the local layout;
        on mismatch nothing is mapped (and ``release`` is not called)."""
        layout = layout_of(caches, block_dim)
        await self._install_storage(_MappedStorage(
            rank, Tier(tier), layout, _block_views(caches, layout), release), "map_storage")
        return layout

    async def map_remote_storage(self, rank: int, tier: Tier, layout: KVLayout,
                                 fetch: RemoteFetch,
                                 release: Optional[Callable[[], None]] = None) -> None:
        """Map a storage of another host: its blocks arrive through ``fetch`` into CPU
        staging rows (bounded by the slab) and are then written like local ones."""
        await self._install_storage(
            _MappedStorage(rank, Tier(tier), layout, {}, release, fetch=fetch),
            "map_remote_storage")

    async def _install_storage(self, st: _MappedStorage, what: str) -> None:
        """Validate ``st`` against the local layout and put it in place (under the lock)."""
        async with self._mapping_lock:
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

    async def unmap_storage(self, rank: int, tier: Optional[Tier] = None) -> int:
        """Drop the mappings of ``rank`` (one tier or all); returns how many."""
        async with self._mapping_lock:
            keys = [k for k in self._storages if k[0] == rank and (tier is None or k[1] == tier)]
            self._fused_cache.clear()
            for k in keys:
                st = self._storages.pop(k)
                if st.release is not None:
                    st.release()
            return len(keys)

    def mapped(self) -> List[Tuple[int, Tier]]:
        return sorted(self._storages)

    # ------------------------------------------------------------------- load
    async def load_gpu_requests_v1(self, batch: LoadBatch,
                                   leases: Sequence[Lease] = ()) -> LoadResult:
        """Load every request of one step; see the module docstring for the contract."""
        try:
            self._check_open("load_gpu_requests_v1")
        except TransferClosedError:
            await self._release_all(leases)
            raise
        task = asyncio.ensure_future(self._load_then_release(batch, leases))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        cancelled = False
        while True:
            try:
                result = await asyncio.shield(task)
                break
            except asyncio.CancelledError:
                if task.done():
                    raise
                cancelled = True  # keep waiting: the copy and the releases must finish
            except BaseException:
                if cancelled:
                    raise asyncio.CancelledError() from None
                raise
        if cancelled:
            raise asyncio.CancelledError()
        return result

    async def _load_then_release(self, batch: LoadBatch, leases: Sequence[Lease]) -> LoadResult:
        try:
            plan = self._plan(batch)
            written = await self._execute(plan)
        finally:
            errors = await self._release_all(leases)
        return LoadResult(plan.request_ids, len(plan.transfers), plan.blocks_written,
                          written[0], written[1], plan.written, tuple(errors))

    def _plan(self, batch: LoadBatch) -> LoadPlan:
        try:
            if not isinstance(batch, LoadBatch):
                raise LoadBatchError(
                    f"batch: expected LoadBatch, got {type(batch).__name__}")
            plan, next_state = plan_step(batch, self.slab_config, self._slab_state)
            self._validate(plan)
        except (LoadBatchError, ConflictingWriteError, LoadRejected) as exc:
            self.counters.rejected_batches += 1
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

    async def _execute(self, plan: LoadPlan) -> Tuple[int, int]:
        layout = self._local_layout
        assert layout is not None and self._slabs is not None
        useful = sum(t.rows * layout.group(t.group).block_bytes for t in plan.transfers)
        padded = sum(t.padded_rows * layout.group(t.group).block_bytes for t in plan.transfers)
        remote = [t for t in plan.transfers
                  if self._storages[(t.source_rank, t.tier)].fetch is not None]
        remote_ids = {id(t) for t in remote}
        local = dataclasses.replace(
            plan, transfers=tuple(t for t in plan.transfers if id(t) not in remote_ids))
        async with self._copy_lock:
            try:
                if local.transfers:
                    await asyncio.to_thread(self._run_transfers, local)
                for t in remote:
                    await self._run_remote(t)
            except BaseException as exc:
                self.counters.load_failures += 1
                logger.error("rank %d: load of %d requests failed during copy: %r", self.rank,
                             len(plan.request_ids), exc)
                raise LoadError(f"copy failed: {exc!r}", plan.written) from exc
        c = self.counters
        c.batch_calls += 1
        c.logical_requests += len(plan.request_ids)
        c.transfers += len(plan.transfers)
        c.useful_bytes += useful
        c.padded_bytes += padded
        c.blocks_written += plan.blocks_written
        return useful, padded

    def _run_transfers(self, plan: LoadPlan) -> None:
        """Runs in a worker thread; returns only when every write is complete.

        All index arrays of the step go to the device in one copy; same-device
        CUDA transfers use the fused kernel when it applies, the others the
        slab-staged torch copy.
        """
        assert self._slabs is not None and self._device is not None
        jobs = []
        arrays: List[np.ndarray] = []
        for t in plan.transfers:
            st = self._storages[(t.source_rank, t.tier)]
            fused = self._fused_ok(st, t.group)
            jobs.append((t, st, fused))
            if fused:
                arrays += [t.src_slots[t.dst_rows], t.dst_blocks]
            else:
                arrays += [t.dst_blocks, t.dst_rows]
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        with ctx:
            indices = iter(self._indices.upload(arrays))
            for t, st, fused in jobs:
                src, dst = st.layers[t.group], self._local_layers[t.group]
                if fused:
                    self._run_fused(st, t, next(indices), next(indices))
                    continue
                dst_blocks, dst_rows = next(indices), next(indices)
                copy_transfer(
                    src, dst, self._slabs.get(t.group, t.slab_rows),
                    torch.from_numpy(t.src_slots).to(src[0].device, non_blocking=True),
                    dst_blocks, dst_rows, t.identity_rows)
            if self._stream is not None:
                self._stream.synchronize()

    async def _run_remote(self, t: Transfer) -> None:
        """Fetch one transfer from a remote storage into CPU staging, then write it."""
        st = self._storages[(t.source_rank, t.tier)]
        assert st.fetch is not None and self._local_layout is not None
        staging = self._staging.get(t.group)
        if staging is None:
            pin = self._device is not None and self._device.type == "cuda"
            staging = self._staging[t.group] = [
                torch.empty((self.slab_config.full_rows, la.block_bytes), dtype=torch.uint8,
                            pin_memory=pin)
                for la in self._local_layout.group(t.group).layers]
        await st.fetch(t, [s[:t.rows] for s in staging])
        await asyncio.to_thread(self._write_staged, t, staging)

    def _write_staged(self, t: Transfer, staging: List[torch.Tensor]) -> None:
        device = self._device
        assert device is not None
        dst_blocks = torch.from_numpy(t.dst_blocks).to(device)
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        with ctx:
            for s, d in zip(staging, self._local_layers[t.group]):
                values = slab_as(s, t.rows, d)
                if not t.identity_rows:
                    values = values.index_select(0, torch.from_numpy(t.dst_rows))
                d.index_copy_(0, dst_blocks, values.to(device, non_blocking=True))
            if self._stream is not None:
                self._stream.synchronize()

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
        self.counters.fused_transfers += 1

    async def _release_all(self, leases: Sequence[Lease]) -> List[str]:
        errors: List[str] = []
        if not leases or self._release_lease is None:
            return errors
        results = await asyncio.gather(*(self._release_lease(lease) for lease in leases),
                                       return_exceptions=True)
        for lease, res in zip(leases, results):
            if isinstance(res, BaseException):
                self.counters.lease_release_failures += 1
                errors.append(f"lease {lease.lease_id} on rank {lease.rank}: {res!r}")
        if errors:
            logger.error("rank %d: %d of %d lease releases failed: %s", self.rank, len(errors),
                         len(leases), "; ".join(errors))
        return errors

    # ------------------------------------------------------------------ close
    def _check_open(self, what: str) -> None:
        if self._closing or self._closed:
            raise TransferClosedError(f"{what}: the transfer engine of rank {self.rank} is closed")

    async def close(self) -> None:
        """Release slabs, mapped storages and local cache references.

        Idempotent.  Waits for loads in flight.  If some release fails, the
        rest is still released, :class:`CloseError` is raised and a later
        ``close()`` retries only what is left.
        """
        if self._closed:
            return
        self._closing = True
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        async with self._mapping_lock:
            errors: List[str] = []
            if self._slabs is not None:
                self._slabs.close()
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
            self._staging.clear()
            self._indices.close()
            self._stream = None
            self._closed = True
            logger.info("rank %d: transfer engine closed", self.rank)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _tensor(item: object) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item  # type: ignore[return-value,index]


def _block_views(caches: Mapping[int, LayerTensors],
                 layout: KVLayout) -> Dict[int, List[torch.Tensor]]:
    views: Dict[int, List[torch.Tensor]] = {}
    for g in layout.groups:
        views[g.group] = [block_view(_tensor(item), la.block_dim)
                          for item, la in zip(caches[g.group], g.layers)]
    return views
