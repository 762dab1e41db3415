"""A rank's snapshot storage memory: a GPU tier under a byte budget, a CPU tier behind it.

The rank's ``TransferActor`` allocates it (and so owns it for the life of the replica); the
rank's vLLM worker maps it (its exports write it, :mod:`.storage_writer` keeps the slots)
and so do the same-host peers that load from it (CUDA IPC for a CUDA tier, shared-memory
files for a CPU tier: :meth:`SnapshotStorage.handles`, :func:`open_tier`).  Peers on other
hosts get blocks through :meth:`SnapshotStorage.gather_rows` (:mod:`.remote_fetch`).

Per tier and KV-cache group there is one tensor per layer, ``[slots, *block_shape]``,
block-first, of the layer's dtype.  A CPU tier on a CUDA host is page-locked
(``TierConfig.pin``) so that copies between it and a GPU run at full speed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..planning.budget import validate_budget
from ..planning.load_batch import Tier
from ..planning.log_names import package_logger
from ..planning.options import XavierOptions
from ..planning.shm_words import (
    DATA_NAME,
    OWNER_NAME,
    owned_name,
    owner_alive,
    remove_files,
    shm_dir,
)
from .block_copy import as_byte_rows, block_view
from .kv_schema import KVLayout, torch_dtype
from .slot_generations import GenerationsHandle, SlotGenerations

logger = package_logger(__name__)

ShmHandles = Dict[int, List[Tuple[str, str, Tuple[int, ...]]]]
#: per tier: ("shm", ShmHandles) or ("ipc", CUDA IPC handles per group and layer)
TierHandles = Dict[int, Tuple[str, Any]]

@dataclass(frozen=True)
class TierConfig:
    """One storage tier of a rank: its tier, byte budget, device and host-memory options."""
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
class _Tier:
    config: TierConfig
    layers: Dict[int, List[torch.Tensor]]  # group -> per-layer tensors (layer dtype)
    views: Dict[int, List[torch.Tensor]]  # group -> block views
    slots: int
    shm_files: List[str] = field(default_factory=list)
    pinned: List[int] = field(default_factory=list)  # data pointers registered with CUDA


class SnapshotStorage:
    """The memory of one rank's storage tiers, owned by its ``TransferActor``: allocated
    for the engine's layout under each tier's budget, handed to the worker and same-host
    peers as mappable handles, freed on :meth:`close` (after which it hands out nothing)."""
    def __init__(self, rank: int, layout: KVLayout, tiers: Sequence[TierConfig]) -> None:
        if not tiers:
            raise ValueError("tiers: at least one storage tier is needed")
        if [t.tier for t in tiers] != sorted(t.tier for t in tiers) or \
                len({t.tier for t in tiers}) != len(tiers):
            raise ValueError("tiers: give each tier once, GPU before CPU")
        self.rank = rank
        self.layout = layout
        self._tiers: Dict[Tier, _Tier] = {}
        self._closed = False
        if any(cfg.shared_memory for cfg in tiers):
            remove_orphaned_shm_files()
        for cfg in tiers:
            self._tiers[Tier(cfg.tier)] = self._allocate(cfg)
        #: the incarnation and every slot's generation, mapped by the worker that writes
        #: the slots and by the peers that read them (:mod:`.slot_generations`)
        self.generations = SlotGenerations.create(
            {(int(t), g.group): self._tiers[t].slots for t in self._tiers
             for g in layout.groups})
        logger.info("rank %d: snapshot storage %s", rank, ", ".join(
            f"{t.name}: {self.slots(t)} slots/group" for t in self._tiers))

    def _allocate(self, cfg: TierConfig) -> _Tier:
        per_group = cfg.budget_bytes // max(1, len(self.layout.groups))
        layers, views, files = {}, {}, []
        if cfg.shared_memory and cfg.device != "cpu":
            raise ValueError(f"shared_memory: only for CPU tensors, not device {cfg.device!r}")
        slots = min(per_group // g.block_bytes for g in self.layout.groups)
        for g in self.layout.groups:
            if per_group // g.block_bytes < 1:
                raise ValueError(
                    f"budget: {cfg.tier.name} tier budget {cfg.budget_bytes} bytes holds no "
                    f"block of KV-cache group {g.group} ({g.block_bytes} bytes per block)")
            tensors = []
            for la in g.layers:
                shape = (slots, *la.block_shape)
                dtype = torch_dtype(la.dtype)
                if cfg.shared_memory:
                    path, t = new_shm_tensor(shape, dtype)
                    files.append(path)
                else:
                    t = torch.empty(shape, dtype=dtype, device=cfg.device)
                tensors.append(t)
            layers[g.group] = tensors
            views[g.group] = [block_view(t, 0) for t in tensors]
        pinned = pin_host([t for ts in layers.values() for t in ts]) if cfg.pin else []
        return _Tier(cfg, layers, views, slots, files, pinned)

    # ------------------------------------------------------------------ views
    @property
    def tiers(self) -> List[Tier]:
        """The tiers this storage has, top first (GPU before CPU)."""
        return sorted(self._tiers)

    def slots(self, tier: Tier) -> int:
        """Slots per group of ``tier`` (every group has as many)."""
        return self._tiers[Tier(tier)].slots

    def config(self, tier: Tier) -> TierConfig:
        return self._tiers[Tier(tier)].config

    def caches(self, tier: Tier) -> Dict[int, List[torch.Tensor]]:
        """Per-group layer tensors of ``tier`` (block dim 0), for ``map_storage``."""
        self._check_open("caches")
        return self._tiers[Tier(tier)].layers

    def views(self, tier: Tier, group: int) -> List[torch.Tensor]:
        """Block views of ``tier``'s layers of ``group`` (tests read slots through them)."""
        self._check_open("views")
        return self._tiers[Tier(tier)].views[group]

    def shm_handles(self, tier: Tier = Tier.CPU) -> ShmHandles:
        """``(path, dtype, shape)`` per layer of a shared-memory tier, for :func:`open_shm`."""
        self._check_open("shm_handles")
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

        self._check_open("ipc_handles")
        t = self._tiers[Tier(tier)]
        if t.config.device == "cpu":
            raise ValueError(f"ipc_handles: the {Tier(tier).name} tier is not on a CUDA device")
        return {g: [reduce_tensor(x) for x in tensors] for g, tensors in t.layers.items()}

    def handles(self) -> TierHandles:
        """How another process of this host maps every tier (:func:`open_tier`)."""
        self._check_open("handles")
        out: TierHandles = {}
        for tier in self.tiers:
            if self._tiers[tier].config.shared_memory:
                out[int(tier)] = ("shm", self.shm_handles(tier))
            else:
                out[int(tier)] = ("ipc", self.ipc_handles(tier))
        return out

    def generations_handle(self) -> GenerationsHandle:
        """How another process of this host maps the slots' generations
        (:meth:`.SlotGenerations.open`)."""
        self._check_open("generations_handle")
        return self.generations.handle()

    def gather_rows(self, tier: Tier, group: int, slots: Sequence[int]) -> List[torch.Tensor]:
        """Per layer, the blocks in ``slots`` as CPU ``uint8`` rows ``[len(slots), bytes]``
        (what a remote loader's staging expects; see :mod:`.remote_fetch`)."""
        self._check_open("gather_rows")
        views = self._tiers[Tier(tier)].views[group]
        idx = torch.as_tensor(list(slots), dtype=torch.int64)
        return [as_byte_rows(v.index_select(0, idx.to(v.device)).cpu()) for v in views]

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the snapshot storage of rank {self.rank} is closed")

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Free the slots (and the shared-memory files), then sweep the orphaned files of
        dead processes of this host, as a storage's start does (so that a killed peer's
        files go when the model is terminated without any storage starting again).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        shared = any(t.shm_files for t in self._tiers.values())
        for t in self._tiers.values():
            unpin_host(t.pinned)
            t.pinned.clear()
            t.layers.clear()
            t.views.clear()
            remove_files(t.shm_files)
            t.shm_files.clear()
        self.generations.close()
        if shared:
            try:
                remove_orphaned_shm_files()
            except OSError as exc:  # (a sweep never fails a close: its own files are gone)
                logger.warning("rank %d: sweeping orphaned shm files: %r", self.rank, exc)


def open_tier(kind: str, handles: Any, pin: bool = False
              ) -> Tuple[Dict[int, List[torch.Tensor]], Callable[[], None]]:
    """Map a tier of another process of this host (:meth:`SnapshotStorage.handles`);
    returns its per-group layer tensors and the function that lets go of them.  ``pin``:
    page-lock a shared-memory tier in this process too (CUDA host copies at full speed)."""
    if kind == "shm":
        caches = open_shm(handles)
        pinned = pin_host([t for ts in caches.values() for t in ts]) if pin else []

        def release() -> None:
            unpin_host(pinned)
            pinned.clear()
            caches.clear()

        return caches, release
    if kind == "ipc":
        caches = open_ipc(handles)
        return caches, caches.clear
    raise ValueError(f"kind: unknown storage tier kind {kind!r} (expected shm or ipc)")


def open_shm(handles: ShmHandles) -> Dict[int, List[torch.Tensor]]:
    """Map another process's shared-memory tier (same host) from :meth:`shm_handles`."""
    out: Dict[int, List[torch.Tensor]] = {}
    for g, layers in handles.items():
        out[g] = []
        for path, dtype, shape in layers:
            out[g].append(torch.from_file(path, shared=True, size=math.prod(shape),
                                          dtype=torch_dtype(dtype)).view(shape))
    return out


def open_ipc(handles: Dict[int, List[Any]]) -> Dict[int, List[torch.Tensor]]:
    """Map another process's CUDA tier from :meth:`SnapshotStorage.ipc_handles`."""
    return {g: [rebuild(*args) for rebuild, args in layers] for g, layers in handles.items()}


def remove_orphaned_shm_files(directory: Optional[str] = None) -> List[str]:
    """Unlink shared-memory files left by dead processes (a replica killed before its
    storage was closed).  A file belongs to the owner lock its name names
    (:mod:`~..planning.shm_words`): it is removed only when that lock is free -- whatever
    pids this process can see (another container's live files stay) -- or, for a file
    without an owner lock (an older version's), when no process of its pid exists here.
    Peers that mapped it keep their mapping; new peers can no longer open it (a miss, never
    wrong KV).  Returns the removed paths."""
    directory = directory or shm_dir()
    removed: List[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    verdicts: Dict[Tuple[int, str], Optional[bool]] = {}
    for name in names:
        m = DATA_NAME.match(name)
        if m is None:
            continue
        pid, token = int(m.group(1)), m.group(2)
        if (pid, token) not in verdicts:
            verdicts[(pid, token)] = owner_alive(directory, pid, token)
        alive = verdicts[(pid, token)]
        if alive or (alive is None and _pid_alive(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    for name in names:  # the owner locks of dead processes that left no data file
        m = OWNER_NAME.match(name)
        if m is not None and (int(m.group(1)), m.group(2)) not in verdicts:
            owner_alive(directory, int(m.group(1)), m.group(2))  # removes a free one
    if removed:
        logger.info("removed %d shared-memory tier files of dead processes", len(removed))
    return removed


def pid_alive(pid: Optional[int]) -> bool:
    """Whether process ``pid`` of this host (PID namespace) exists; False for None."""
    return pid is not None and _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def new_shm_tensor(shape: Tuple[int, ...], dtype: torch.dtype) -> Tuple[str, torch.Tensor]:
    """A new tensor backed by a file in :func:`shm_dir` (this process's name on it), and the
    file's path: other processes of the host map it with :func:`open_shm`; the caller
    unlinks it."""
    path = owned_name()
    tensor = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype)
    return path, tensor.view(shape)


#: ``cudaHostRegisterPortable | cudaHostRegisterMapped``: every CUDA context of the process
#: sees the memory as page-locked, and it has a device address (the CUDA views of :mod:`.uva`)
HOST_REGISTER_FLAGS = 0x01 | 0x02


def pin_host(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Page-lock CPU ``tensors`` with CUDA (mapped: :data:`HOST_REGISTER_FLAGS`); returns
    the registered pointers (none without CUDA).  A registration that fails is logged and
    leaves that tensor pageable."""
    if not torch.cuda.is_available():
        return []
    cudart = torch.cuda.cudart()
    done = []
    for t in tensors:
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                      HOST_REGISTER_FLAGS)
        if int(err) != 0:
            logger.warning("snapshot storage: cudaHostRegister of %d bytes failed (%s); "
                           "the CPU tier stays pageable", t.numel() * t.element_size(), err)
            continue
        done.append(t.data_ptr())
    return done


def unpin_host(pointers: Sequence[int]) -> None:
    if pointers:
        cudart = torch.cuda.cudart()
        for ptr in pointers:
            cudart.cudaHostUnregister(ptr)


def tier_configs(opts: XavierOptions, layout: KVLayout, device: torch.device) -> List[TierConfig]:
    """Storage tiers for ``opts``; a budget that holds no block (of every group), or a CPU
    tier larger than /dev/shm's free space, fails naming the option and the value."""
    block_bytes = sum(g.block_bytes for g in layout.groups)
    tiers = []
    if device.type == "cuda" and opts.gpu_budget_bytes > 0:
        budget = validate_budget("xavier_gpu_budget", opts.gpu_budget_bytes, block_bytes)
        tiers.append(TierConfig(Tier.GPU, budget, device=str(device)))
    cpu_bytes = opts.cpu_budget_bytes
    option = "xavier_cpu_budget"
    if device.type == "cpu" and opts.gpu_budget_bytes:
        # no GPU: one tier in shared memory holds both budgets
        cpu_bytes += opts.gpu_budget_bytes
        option = "xavier_gpu_budget + xavier_cpu_budget"
    if cpu_bytes > 0:
        budget = validate_budget(option, cpu_bytes, block_bytes,
                                 available_bytes=shm_free_bytes())
        tiers.append(TierConfig(Tier.CPU, budget, shared_memory=True,
                                pin=device.type == "cuda"))
    if not tiers:
        raise ValueError("xavier_cpu_budget: no storage tier on this device (the GPU tier "
                         "needs a CUDA engine): set xavier_cpu_budget above 0")
    return tiers


def shm_free_bytes() -> Optional[int]:
    """Free bytes of /dev/shm (None when it cannot be read)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
