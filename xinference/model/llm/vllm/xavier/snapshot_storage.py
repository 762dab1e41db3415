"""A rank's snapshot storage: a GPU tier under a byte budget, a CPU tier behind it.

Storage holds whole KV blocks in slots, per tier and KV-cache group (one
tensor per layer, ``[slots, *block_shape]``, block-first).  Peers read it
through :meth:`GPUTransfer.map_storage` with :meth:`SnapshotStorage.caches`.

:meth:`SnapshotStorage.export` copies newly computed full blocks of this
rank's engine into the top tier, batched per step:

1. blocks already stored are only touched (LRU);
2. slots come from the free list, else from LRU victims that the block
   directory grants (``claim``: a slot under lease is refused, so it is never
   reused while a peer reads it);
3. before a victim of the GPU tier is given up, its block is demoted into
   the CPU tier (when there is one) and registered there; blocks the top tier
   cannot take in this step go straight to the next tier down;
4. the copies are fenced (CUDA: synchronized) and only then the blocks are
   registered with the directory: a block is never published before its
   bytes are written.

Copies run in a worker thread (under the storage's lock), so a long export does not
hold up the event loop it is awaited on (a replica's pool also streams its tokens
there).  A CPU tier on a CUDA host can be page-locked (``TierConfig.pin``): demotions
copy device to host at full speed (``benchmarks/export_bench.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .block_copy import as_byte_rows, block_view, slab_as
from .block_directory import BlockDirectory
from .counters import elapsed_us
from .kv_schema import KVLayout
from .load_batch import Tier
from .slot_allocator import SlotAllocator

logger = logging.getLogger(__name__)

#: (group, key, tier, slot, generation), as the block directory records it
Entry = Tuple[int, int, int, int, int]
ShmHandles = Dict[int, List[Tuple[str, str, Tuple[int, ...]]]]

#: blocks a background :meth:`SnapshotStorage.make_room` frees per hold of the lock
ROOM_CHUNK_BLOCKS = 64

_TORCH_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32,
                                     torch.float64, torch.uint8, torch.int8)}


class DirectoryClient(Protocol):
    """What storage needs of the block directory (the tracker actor ref fits)."""

    async def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        ...

    async def register(self, rank: int, entries: Sequence[Entry]) -> int: ...


class LocalDirectory:
    """In-process :class:`DirectoryClient` over a :class:`BlockDirectory`."""

    def __init__(self, directory: Optional[BlockDirectory] = None) -> None:
        self.directory = directory or BlockDirectory()

    async def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return self.directory.claim(rank, tier, group, list(slots))

    async def register(self, rank: int, entries: Sequence[Entry]) -> int:
        return self.directory.register(rank, list(entries))


@dataclass(frozen=True)
class TierConfig:
    tier: Tier
    budget_bytes: int
    device: str = "cpu"
    #: CPU tensors only: back the slots with files in /dev/shm so other processes
    #: of this host can map them (:meth:`SnapshotStorage.shm_handles`)
    shared_memory: bool = False
    #: CPU tensors only: page-lock them with CUDA (``cudaHostRegister``) when CUDA is
    #: available, so that copies between this tier and a GPU run at full speed; ignored
    #: without CUDA
    pin: bool = False


@dataclass
class ExportResult:
    """What one export did, and where its time went (µs: ``copy_us`` every block copy and
    its fence, demotions' included; ``directory_us`` every claim and registration)."""

    exported: int = 0
    already_stored: int = 0
    skipped_no_slot: int = 0
    demoted: int = 0
    evicted: int = 0
    claims_refused: int = 0
    copy_us: int = 0
    directory_us: int = 0

    def add(self, field_name: str) -> Callable[[int], None]:
        """A callback adding µs to ``field_name`` (for :func:`~.counters.elapsed_us`)."""
        return lambda us: setattr(self, field_name, getattr(self, field_name) + us)


@dataclass
class _Tier:
    config: TierConfig
    layers: Dict[int, List[torch.Tensor]]  # group -> per-layer tensors (layer dtype)
    views: Dict[int, List[torch.Tensor]]  # group -> block views
    allocators: Dict[int, SlotAllocator]
    shm_files: List[str] = field(default_factory=list)
    pinned: List[int] = field(default_factory=list)  # data pointers registered with CUDA


class SnapshotStorage:
    def __init__(self, rank: int, layout: KVLayout, tiers: Sequence[TierConfig],
                 directory: DirectoryClient) -> None:
        if not tiers:
            raise ValueError("tiers: at least one storage tier is needed")
        if [t.tier for t in tiers] != sorted(t.tier for t in tiers) or \
                len({t.tier for t in tiers}) != len(tiers):
            raise ValueError("tiers: give each tier once, GPU before CPU")
        self.rank = rank
        self.layout = layout
        self._directory = directory
        self._tiers: Dict[Tier, _Tier] = {}
        self._lock = asyncio.Lock()
        self._closed = False
        if any(cfg.shared_memory for cfg in tiers):
            remove_orphaned_shm_files()
        for cfg in tiers:
            self._tiers[Tier(cfg.tier)] = self._allocate(cfg)
        logger.info("rank %d: snapshot storage %s", rank, ", ".join(
            f"{t.name}: {self.slots(t)} slots/group" for t in self._tiers))

    def _allocate(self, cfg: TierConfig) -> _Tier:
        per_group = cfg.budget_bytes // max(1, len(self.layout.groups))
        layers, views, allocs, files = {}, {}, {}, []
        if cfg.shared_memory and cfg.device != "cpu":
            raise ValueError(f"shared_memory: only for CPU tensors, not device {cfg.device!r}")
        for g in self.layout.groups:
            slots = per_group // g.block_bytes
            if slots < 1:
                raise ValueError(
                    f"budget: {cfg.tier.name} tier budget {cfg.budget_bytes} bytes holds no "
                    f"block of KV-cache group {g.group} ({g.block_bytes} bytes per block)")
            tensors = []
            for la in g.layers:
                shape = (slots, *la.block_shape)
                dtype = _TORCH_DTYPES[la.dtype]
                if cfg.shared_memory:
                    path = os.path.join(_shm_dir(), f"xavier-{os.getpid()}-{uuid.uuid4().hex}")
                    t = torch.from_file(path, shared=True, size=math.prod(shape),
                                        dtype=dtype).view(shape)
                    files.append(path)
                else:
                    t = torch.empty(shape, dtype=dtype, device=cfg.device)
                tensors.append(t)
            layers[g.group] = tensors
            views[g.group] = [block_view(t, 0) for t in tensors]
            allocs[g.group] = SlotAllocator(slots)
        pinned = _pin([t for ts in layers.values() for t in ts]) if cfg.pin else []
        return _Tier(cfg, layers, views, allocs, files, pinned)

    # ------------------------------------------------------------------ views
    @property
    def tiers(self) -> List[Tier]:
        """The tiers this storage has, top first (GPU before CPU)."""
        return sorted(self._tiers)

    def slots(self, tier: Tier) -> int:
        return min(a.num_slots for a in self._tiers[Tier(tier)].allocators.values())

    def caches(self, tier: Tier) -> Dict[int, List[torch.Tensor]]:
        """Per-group layer tensors of ``tier`` (block dim 0), for ``map_storage``."""
        return self._tiers[Tier(tier)].layers

    def shm_handles(self, tier: Tier = Tier.CPU) -> ShmHandles:
        """``(path, dtype, shape)`` per layer of a shared-memory tier, for :func:`open_shm`."""
        t = self._tiers[Tier(tier)]
        if not t.config.shared_memory:
            raise ValueError(f"shm_handles: the {Tier(tier).name} tier is not in shared memory")
        out, files = {}, iter(t.shm_files)
        for g, tensors in t.layers.items():
            out[g] = [(next(files), str(x.dtype), tuple(x.shape)) for x in tensors]
        return out

    def ipc_handles(self, tier: Tier = Tier.GPU) -> Dict[int, List[Any]]:
        """CUDA IPC handles of a CUDA tier, per group and layer, for :func:`open_ipc` in
        another process of this host (torch's own CUDA tensor sharing)."""
        from torch.multiprocessing.reductions import reduce_tensor

        t = self._tiers[Tier(tier)]
        if t.config.device == "cpu":
            raise ValueError(f"ipc_handles: the {Tier(tier).name} tier is not on a CUDA device")
        return {g: [reduce_tensor(x) for x in tensors] for g, tensors in t.layers.items()}

    def gather_rows(self, tier: Tier, group: int, slots: Sequence[int]) -> List[torch.Tensor]:
        """Per layer, the blocks in ``slots`` as CPU ``uint8`` rows ``[len(slots), bytes]``
        (what a remote loader's staging expects; see :mod:`.remote_fetch`)."""
        if self._closed:
            raise RuntimeError(f"gather_rows: the snapshot storage of rank {self.rank} is closed")
        views = self._tiers[Tier(tier)].views[group]
        idx = torch.as_tensor(list(slots), dtype=torch.int64)
        return [as_byte_rows(v.index_select(0, idx.to(v.device)).cpu()) for v in views]

    def used(self, tier: Tier) -> int:
        return sum(a.used for a in self._tiers[Tier(tier)].allocators.values())

    def lookup(self, group: int, key: int) -> Optional[Tuple[Tier, int, int]]:
        for tier, t in self._tiers.items():
            hit = t.allocators[group].lookup(key, touch=False)
            if hit is not None:
                return tier, hit[0], hit[1]
        return None

    # ----------------------------------------------------------------- export
    async def export(self, kv_views: Dict[int, List[torch.Tensor]],
                     blocks: Sequence[Tuple[int, int, int]]) -> ExportResult:
        """Store ``(group, key, block_id)`` blocks of this rank's KV caches (block views,
        as :func:`~.block_copy.block_view` gives) and publish them once fenced."""
        if self._closed:
            raise RuntimeError(f"export: the snapshot storage of rank {self.rank} is closed")
        async with self._lock:
            res = ExportResult()
            top = self._tiers[min(self._tiers)]
            by_group: Dict[int, List[Tuple[int, int]]] = {}
            seen = set()
            for group, key, block_id in blocks:
                if group not in top.allocators:
                    raise ValueError(f"group: KV-cache group {group} is not stored")
                if any(t.allocators[group].lookup(key) is not None for t in self._tiers.values()):
                    res.already_stored += 1
                    continue
                if (group, key) not in seen:  # a step may name one block twice
                    seen.add((group, key))
                    by_group.setdefault(group, []).append((key, block_id))
            entries: List[Entry] = []
            copies: List[_Copy] = []
            for group, pending in by_group.items():
                # earlier blocks of a prefix are shared more: they go to the top tier,
                # what it cannot take goes one tier down
                for tier in sorted(self._tiers):
                    if not pending:
                        break
                    t = self._tiers[tier]
                    slots = await self._slots_for(tier, group, len(pending), res)
                    placed, pending = pending[:len(slots)], pending[len(slots):]
                    if not placed:
                        continue
                    gens = [t.allocators[group].assign(key, slot)
                            for (key, _), slot in zip(placed, slots)]
                    copies.append((kv_views[group], t.views[group], [b for _, b in placed],
                                   slots))
                    entries += [(group, key, int(tier), slot, gen)
                                for (key, _), slot, gen in zip(placed, slots, gens)]
                res.skipped_no_slot += len(pending)
            if copies:
                with elapsed_us(res.add("copy_us")):
                    await asyncio.to_thread(_copy_and_fence, copies, self._tiers)
            if entries:
                with elapsed_us(res.add("directory_us")):
                    await self._directory.register(self.rank, entries)
            res.exported = len(entries)
            return res

    async def make_room(self, free_blocks: int) -> ExportResult:
        """Keep up to ``free_blocks`` slots free in the top tier of every group ahead of
        the next export: LRU victims are demoted now (when there is a lower tier) and
        claimed, so that an export of that many blocks only copies its own blocks.  Meant
        to run in the background between steps (``TransferActor`` does).  Works in
        chunks of :data:`ROOM_CHUNK_BLOCKS`, taking the storage lock for each, so that an
        export arriving meanwhile waits for one chunk at most.  Leased victims are
        refused by the claim and stay.  Returns what it did (``evicted``, ``demoted``,
        ``claims_refused``, times)."""
        res = ExportResult()
        tier = self.tiers[0]
        for group, alloc in self._tiers[tier].allocators.items():
            while True:
                async with self._lock:
                    need = min(free_blocks, alloc.num_slots) - alloc.free
                    if self._closed or need <= 0:
                        break
                    if not await self._evict(tier, group, min(need, ROOM_CHUNK_BLOCKS), res):
                        break  # every victim leased: the next export copes
        return res

    async def _slots_for(self, tier: Tier, group: int, count: int,
                         res: ExportResult) -> List[int]:
        """Up to ``count`` slots of ``tier`` ready to be written (free or granted victims)."""
        alloc = self._tiers[tier].allocators[group]
        slots = self._take_free(alloc, count)
        if len(slots) < count and await self._evict(tier, group, count - len(slots), res):
            slots += self._take_free(alloc, count - len(slots))
        return slots

    @staticmethod
    def _take_free(alloc: SlotAllocator, count: int) -> List[int]:
        slots: List[int] = []
        while len(slots) < count:
            free = alloc.take_free()
            if free is None:
                break
            slots.append(free)
        return slots

    async def _evict(self, tier: Tier, group: int, count: int, res: ExportResult) -> int:
        """Free up to ``count`` slots of ``tier``/``group``: LRU victims, their blocks
        first demoted into the next tier down (if any), then claimed from the directory
        (leased ones are refused).  Returns how many slots were freed."""
        alloc = self._tiers[tier].allocators[group]
        victims = alloc.victims(count)
        if not victims:
            return 0
        lower = [x for x in self._tiers if x > tier]
        if lower:  # keep victims' blocks in the next tier down before giving slots up
            await self._demote(tier, lower[0], group, victims, res)
        with elapsed_us(res.add("directory_us")):
            granted = await self._directory.claim(self.rank, int(tier), group, victims)
        res.claims_refused += len(victims) - len(granted)
        for slot in granted:
            alloc.release(slot)
            res.evicted += 1
        return len(granted)

    async def _demote(self, src_tier: Tier, dst_tier: Tier, group: int,
                      victims: Sequence[int], res: ExportResult) -> None:
        src, dst = self._tiers[src_tier], self._tiers[dst_tier]
        keys = [src.allocators[group].key_of(s) for s in victims]
        todo = [(k, s) for k, s in zip(keys, victims)
                if k is not None and dst.allocators[group].lookup(k, touch=False) is None]
        if not todo:
            return
        slots = await self._slots_for(dst_tier, group, len(todo), res)
        todo = todo[:len(slots)]
        gens = [dst.allocators[group].assign(k, slot) for (k, _), slot in zip(todo, slots)]
        with elapsed_us(res.add("copy_us")):
            await asyncio.to_thread(
                _copy_and_fence, [(src.views[group], dst.views[group], [s for _, s in todo],
                                   slots)], {dst_tier: dst, src_tier: src})
        with elapsed_us(res.add("directory_us")):
            await self._directory.register(
                self.rank, [(group, k, int(dst_tier), slot, gen)
                            for (k, _), slot, gen in zip(todo, slots, gens)])
        res.demoted += len(todo)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Free the slots (and the shared-memory files). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._tiers.values():
            _unpin(t.pinned)
            t.pinned.clear()
            t.layers.clear()
            t.views.clear()
            for path in t.shm_files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            t.shm_files.clear()


def open_shm(handles: ShmHandles) -> Dict[int, List[torch.Tensor]]:
    """Map another process's shared-memory tier (same host) from :meth:`shm_handles`."""
    out: Dict[int, List[torch.Tensor]] = {}
    for g, layers in handles.items():
        out[g] = []
        for path, dtype, shape in layers:
            out[g].append(torch.from_file(path, shared=True, size=math.prod(shape),
                                          dtype=_TORCH_DTYPES[dtype]).view(shape))
    return out


def open_ipc(handles: Dict[int, List[Any]]) -> Dict[int, List[torch.Tensor]]:
    """Map another process's CUDA tier from :meth:`SnapshotStorage.ipc_handles`."""
    return {g: [rebuild(*args) for rebuild, args in layers] for g, layers in handles.items()}


_SHM_NAME = re.compile(r"^xavier-(\d+)-[0-9a-f]{32}$")


def remove_orphaned_shm_files(directory: Optional[str] = None) -> List[str]:
    """Unlink shared-memory tier files left by dead processes (a replica killed before its
    storage was closed).  A file is named after its owner's pid; it is removed only when no
    process of that pid exists here.  Peers that mapped it keep their mapping; new peers can
    no longer open it (a miss, never wrong KV).  Returns the removed paths."""
    directory = directory or _shm_dir()
    removed: List[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _SHM_NAME.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    if removed:
        logger.info("removed %d shared-memory tier files of dead processes", len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _copy_rows(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
               src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every layer (block views, any layouts)."""
    if not src_rows:
        return
    si = torch.tensor(list(src_rows), dtype=torch.int64)
    di = torch.tensor(list(dst_rows), dtype=torch.int64)
    for s, d in zip(src, dst):
        rows = as_byte_rows(s.index_select(0, si.to(s.device)))
        d.index_copy_(0, di.to(d.device), slab_as(rows, len(src_rows), d).to(d.device))


#: one copy of :func:`_copy_rows`: source views, destination views, source rows, dest rows
_Copy = Tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int], Sequence[int]]


def _copy_and_fence(copies: Sequence[_Copy], tiers: Dict[Tier, _Tier]) -> None:
    """Every copy, then the fence (runs in a worker thread)."""
    for src, dst, src_rows, dst_rows in copies:
        _copy_rows(src, dst, src_rows, dst_rows)
    _fence(tiers)


def _pin(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Page-lock CPU ``tensors`` with CUDA; returns the registered pointers (none without
    CUDA).  A registration that fails is logged and leaves that tensor pageable."""
    if not torch.cuda.is_available():
        return []
    cudart = torch.cuda.cudart()
    done = []
    for t in tensors:
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            logger.warning("snapshot storage: cudaHostRegister of %d bytes failed (%s); "
                           "the CPU tier stays pageable", t.numel() * t.element_size(), err)
            continue
        done.append(t.data_ptr())
    return done


def _unpin(pointers: Sequence[int]) -> None:
    if pointers:
        cudart = torch.cuda.cudart()
        for ptr in pointers:
            cudart.cudaHostUnregister(ptr)


def _fence(tiers: Dict[Tier, _Tier]) -> None:
    """Wait for every CUDA tier's device (whichever device this thread has current)."""
    devices = {t.config.device for t in tiers.values() if t.config.device != "cpu"}
    if devices and torch.cuda.is_available():
        for device in devices:
            torch.cuda.synchronize(device)
