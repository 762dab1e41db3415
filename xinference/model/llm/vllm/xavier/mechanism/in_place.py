"""vLLM's own KV cache as a tier other processes of the host read in place.

The worker that owns the caches describes them (:func:`describe_caches`): CUDA IPC handles
of its layer tensors on a GPU, or, on vLLM's CPU build, shared-memory files -- its KV
cache is private memory there, so :func:`share_host_caches` first moves every layer's
storage into a file of ``/dev/shm`` *in place* (``Tensor.set_``: the tensor objects vLLM's
attention layers hold see the new memory; done once, at ``register_kv_caches``, before the
first real forward).  A peer maps the description with :func:`open_caches` and reads the
blocks like a snapshot tier's slots (``Tier.VLLM``: slot = vLLM block id), checking each
read against the engine's block generations after its copy (:mod:`.slot_generations`,
:mod:`..planning.in_place`).  Across hosts the source's transfer actor serves them
(:class:`InPlaceSource`), reading the generations after its gather.

Nothing here writes vLLM's blocks: readers copy out of them.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..planning.load_batch import Tier
from ..planning.log_names import package_logger
from ..planning.shm_words import owned_name, remove_files
from .block_copy import as_byte_rows, block_views
from .host_index import HostIndex
from .kv_schema import KVLayout, layout_of, torch_dtype
from .slot_generations import GenerationsHandle, SlotGenerations
from .snapshot_storage import open_ipc, pin_host, shm_free_bytes, unpin_host

logger = package_logger(__name__)

#: per layer: (file, dtype, shape, stride, offset in elements, file bytes)
ShmLayer = Tuple[str, str, Tuple[int, ...], Tuple[int, ...], int, int]


@dataclass(frozen=True)
class CacheHandles:
    """How another process of the host maps one worker's vLLM KV cache: ``kind`` ``shm``
    (per group, per layer :data:`ShmLayer`) or ``ipc`` (torch's CUDA tensor sharing), each
    group's block dimension, and the engine's block generations."""

    kind: str
    layers: Dict[int, List[Any]]
    block_dims: Dict[int, int]
    generations: GenerationsHandle
    num_blocks: int
    #: the worker's host index (:mod:`.host_index`; "" without one)
    index: str = ""


@dataclass
class SharedHostCaches:
    """The shared-memory files a CPU engine's caches were moved into (the worker owns them:
    :meth:`close` removes them once the engine is gone)."""

    files: List[str] = field(default_factory=list)
    layers: Dict[int, List[ShmLayer]] = field(default_factory=dict)

    def close(self) -> None:
        remove_files(self.files)
        self.files = []


def share_host_caches(groups: Dict[int, List[torch.Tensor]],
                      others: Sequence[torch.Tensor] = ()) -> SharedHostCaches:
    """Move CPU layer tensors ``groups`` (and ``others``: every other tensor object vLLM
    holds over the same memory) into shared-memory files, in place: each distinct storage
    gets one file with its bytes, and every tensor of it is re-pointed there (``set_``) at
    its own offset, size and stride, so that tensors sharing memory still do.  Returns the
    files and, per group, how a peer maps each layer.  Raises for a non-CPU tensor."""
    out = SharedHostCaches()
    tensors = [t for ts in groups.values() for t in ts] + list(others)
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"KV cache: a {t.device} tensor is not host memory")
    keys = {id(t): t.untyped_storage().data_ptr() for t in tensors}  # before any set_
    need = cache_bytes({0: tensors})
    free = shm_free_bytes()
    if free is not None and need > free:  # a sparse file past the end of tmpfs: SIGBUS
        raise ValueError(
            f"xavier_in_place: vLLM's KV cache ({need} bytes, VLLM_CPU_KVCACHE_SPACE) does "
            f"not fit the free space of /dev/shm ({free} bytes): give /dev/shm more room "
            "(docker --shm-size or --ipc=host) or launch with XAVIER_IN_PLACE=0")
    moved: Dict[int, Tuple[str, torch.Tensor]] = {}
    done: Set[int] = set()  # ids of the tensor objects re-pointed (``tensors`` holds them)
    try:
        for t in tensors:
            key = keys[id(t)]
            if key not in moved:
                storage = t.untyped_storage()
                path = owned_name()
                new = torch.from_file(path, shared=True, size=storage.nbytes(),
                                      dtype=torch.uint8)
                out.files.append(path)
                new.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
                moved[key] = (path, new)
            if id(t) not in done:
                t.set_(moved[key][1].untyped_storage(), t.storage_offset(), t.size(),
                       t.stride())
                done.add(id(t))
        for g, layers in groups.items():
            out.layers[g] = []
            for t in layers:
                path, new = moved[keys[id(t)]]
                out.layers[g].append((path, str(t.dtype),
                                      tuple(t.shape), tuple(t.stride()),
                                      int(t.storage_offset()), int(new.numel())))
    except BaseException:
        out.close()
        raise
    return out


def describe_caches(groups: Dict[int, List[torch.Tensor]], block_dims: Dict[int, int],
                    generations: SlotGenerations, num_blocks: int,
                    shared: Optional[SharedHostCaches] = None, index: str = "") -> CacheHandles:
    """How peers map ``groups`` (CUDA tensors; or CPU tensors already in ``shared``)."""
    if shared is not None:
        return CacheHandles("shm", dict(shared.layers), dict(block_dims), generations.handle(),
                            num_blocks, index)
    from torch.multiprocessing.reductions import reduce_tensor

    return CacheHandles("ipc", {g: [reduce_tensor(t) for t in ts] for g, ts in groups.items()},
                        dict(block_dims), generations.handle(), num_blocks, index)


@dataclass
class InPlaceShare:
    """What one worker shares of its own vLLM cache: the engine's block generations (the
    scheduler bumps them), how peers map the cache, and the host index same-host
    schedulers probe (None: ``xavier_host_index`` off).  The worker owns them all."""

    generations: SlotGenerations
    handles: CacheHandles
    index: Optional[HostIndex] = None

    @classmethod
    def create(cls, caches: Dict[int, List[torch.Tensor]], block_dims: Dict[int, int],
               num_blocks: int, shared: Optional[SharedHostCaches], rank: int, tp_rank: int,
               host_index: bool, tier_bytes: int = 0) -> InPlaceShare:
        """``tier_bytes``: the budget of Xavier's tiers (the host index makes room for as
        many entries as they may hold blocks of these caches)."""
        gens = SlotGenerations.create_shared(int(Tier.VLLM), sorted(caches), num_blocks)
        index: Optional[HostIndex] = None
        try:
            if host_index:
                try:
                    per_block = sum(t.numel() * t.element_size() for ts in caches.values()
                                    for t in ts) // max(1, num_blocks)
                    index = HostIndex.create(rank, tp_rank, gens,
                                             gens.row(int(Tier.VLLM), min(caches)),
                                             tier_blocks=tier_bytes // max(1, per_block))
                except OSError as exc:  # e.g. /dev/shm full: peers then ask the directory
                    logger.warning("xavier: rank %d: no host index (%r): same-host peers "
                                   "find this replica's blocks through the directory", rank,
                                   exc)
            handles = describe_caches(caches, block_dims, gens, num_blocks, shared,
                                      index.path if index is not None else "")
        except BaseException:
            if index is not None:
                index.close()
            gens.close()
            raise
        return cls(gens, handles, index)

    def close(self) -> None:
        """Remove the files (peers' mappings keep what they mapped).  Idempotent."""
        if self.index is not None:
            self.index.close()
        self.generations.close()


def open_caches(handles: CacheHandles, pin: bool = False
                ) -> Tuple[Dict[int, List[torch.Tensor]], Callable[[], None]]:
    """Map another worker's KV cache from ``handles``; returns its layer tensors per group
    (vLLM's shapes: block dimension ``handles.block_dims``) and the function that lets go.
    ``pin``: page-lock a host cache here (CUDA copies from it at full speed)."""
    if handles.kind == "ipc":
        shared = open_ipc(handles.layers)
        return shared, shared.clear
    if handles.kind != "shm":
        raise ValueError(f"kind: unknown KV cache kind {handles.kind!r} (expected shm or ipc)")
    files: Dict[str, torch.Tensor] = {}
    caches: Dict[int, List[torch.Tensor]] = {}
    for g, layers in handles.layers.items():
        caches[g] = []
        for path, dtype, shape, stride, offset, nbytes in layers:
            if path not in files:
                files[path] = _map_existing(path, nbytes)
            flat = files[path].view(torch_dtype(dtype))
            caches[g].append(torch.as_strided(flat, shape, stride, offset))
    pinned = pin_host(list(files.values())) if pin else []

    def release() -> None:
        unpin_host(pinned)
        pinned.clear()
        caches.clear()
        files.clear()

    return caches, release


def _map_existing(path: str, nbytes: int) -> torch.Tensor:
    """``path`` mapped shared as ``uint8[nbytes]``; a missing or shorter file is an error
    (``torch.from_file`` would create a zero-filled one: a cache of zeros read as blocks)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"KV cache file {path}: {size} bytes, expected {nbytes}")
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class InPlaceSource:
    """One worker's vLLM KV cache as its transfer actor reads it for peers on other hosts:
    the same interface as :class:`~.snapshot_storage.SnapshotStorage` for
    :func:`~.remote_fetch.serve_blocks` (``gather_rows``, ``generations``)."""

    def __init__(self, handles: CacheHandles) -> None:
        caches, self._release = open_caches(handles)
        try:
            self.layout: KVLayout = layout_of(caches, handles.block_dims)
            self._views = block_views(caches, self.layout)
            self.generations = SlotGenerations.open(handles.generations)
        except BaseException:
            self._release()
            raise

    def gather_rows(self, tier: Tier, group: int, slots: Sequence[int]) -> List[torch.Tensor]:
        """Per layer, the blocks ``slots`` as CPU ``uint8`` rows ``[len(slots), bytes]``."""
        if Tier(tier) != Tier.VLLM:
            raise ValueError(f"tier: the vLLM cache serves tier VLLM, not {Tier(tier).name}")
        views = self._views[group]
        idx = torch.as_tensor(list(slots), dtype=torch.int64)
        return [as_byte_rows(v.index_select(0, idx.to(v.device)).cpu()) for v in views]

    def close(self) -> None:
        self._views = {}
        self.generations.close()
        self._release()


def cache_bytes(groups: Dict[int, List[torch.Tensor]]) -> int:
    """Bytes of the distinct memory behind ``groups`` (what sharing the cache exposes)."""
    seen: Dict[int, int] = {}
    for layers in groups.values():
        for t in layers:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values()) if seen else 0

