"""Handing an engine's KV caches to the transfer actor in another process of the host.

The transfer actor copies loads straight into the engine's KV caches and
exports from them, so it maps them:

* CUDA: torch's CUDA IPC (:func:`torch.multiprocessing.reductions.reduce_tensor`)
  of each layer tensor;
* CPU: the caches' storage is moved into shared memory *in place*
  (``UntypedStorage._share_filename_cpu_``, what ``torch.multiprocessing``'s
  ``file_system`` strategy uses: every view of the storage follows, contents are
  kept) and the actor opens the same file (``_new_shared_filename_cpu``).  Call
  this before the engine serves (``register_kv_caches`` time).

:func:`group_layers` groups vLLM's ``{layer_name: tensor}`` by KV-cache group and
finds each group's block dimension (the dimension of size ``num_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                               torch.uint8, torch.int8, torch.float8_e4m3fn,
                               torch.float8_e5m2)}


class KVHandleError(ValueError):
    """The caches cannot be shared or opened; the message says which layer and why."""


@dataclass(frozen=True)
class LayerHandle:
    name: str
    kind: str  # "cuda_ipc" | "cpu_shm"
    payload: Any  # reduce_tensor output, or (manager, filename, nbytes)
    dtype: str
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int  # in elements of dtype (cpu_shm)


@dataclass(frozen=True)
class CacheHandles:
    """Per group: the layers' handles and the block dimension."""

    groups: Dict[int, Tuple[LayerHandle, ...]]
    block_dims: Dict[int, int]


GroupedLayers = Dict[int, List[Tuple[str, torch.Tensor]]]


def group_layers(kv_caches: Mapping[str, torch.Tensor],
                 group_layer_names: Sequence[Sequence[str]],
                 num_blocks: int) -> Tuple[GroupedLayers, Dict[int, int]]:
    """``{group: [(name, tensor)]}`` (layers sharing one tensor listed once) and the block
    dimension of each group."""
    groups: Dict[int, List[Tuple[str, torch.Tensor]]] = {}
    dims: Dict[int, int] = {}
    for g, names in enumerate(group_layer_names):
        seen = set()
        layers = []
        for name in names:
            if name not in kv_caches:
                continue
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor):
                raise KVHandleError(f"layer {name}: KV cache is {type(t).__name__}, "
                                    "not one tensor (unsupported attention backend)")
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key in seen:
                continue
            seen.add(key)
            layers.append((name, t))
        if not layers:
            continue
        dims[g] = block_dim_of(layers[0][1], num_blocks, layers[0][0])
        for name, t in layers[1:]:
            if block_dim_of(t, num_blocks, name) != dims[g]:
                raise KVHandleError(f"layer {name}: block dimension differs within group {g}")
        groups[g] = layers
    if not groups:
        raise KVHandleError("kv_caches: no layer of any KV-cache group was registered")
    return groups, dims


def block_dim_of(t: torch.Tensor, num_blocks: int, name: str = "layer") -> int:
    """The dimension of size ``num_blocks`` (the outermost when several match)."""
    dims = [d for d, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise KVHandleError(f"{name}: no dimension of size num_blocks={num_blocks} in shape "
                            f"{tuple(t.shape)} (kernel block size differs from the "
                            "scheduler's: unsupported)")
    return dims[0]


def share(groups: Mapping[int, Sequence[Tuple[str, torch.Tensor]]],
          block_dims: Mapping[int, int]) -> CacheHandles:
    """Handles for :func:`open_handles` in another process of this host."""
    out: Dict[int, Tuple[LayerHandle, ...]] = {}
    for g, layers in groups.items():
        out[g] = tuple(_share_one(name, t) for name, t in layers)
    return CacheHandles(out, dict(block_dims))


def _share_one(name: str, t: torch.Tensor) -> LayerHandle:
    dtype = str(t.dtype)
    if dtype not in _DTYPES:
        raise KVHandleError(f"layer {name}: dtype {dtype} not supported")
    if t.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        return LayerHandle(name, "cuda_ipc", reduce_tensor(t), dtype, tuple(t.shape),
                           tuple(t.stride()), 0)
    if t.device.type != "cpu":
        raise KVHandleError(f"layer {name}: device {t.device} cannot be shared")
    storage = t.untyped_storage()
    manager, filename, nbytes = storage._share_filename_cpu_()  # in place; views follow
    return LayerHandle(name, "cpu_shm", (manager, filename, int(nbytes)), dtype,
                       tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def open_handles(handles: CacheHandles) -> Dict[int, List[Tuple[str, torch.Tensor]]]:
    """The engine's layer tensors, mapped into this process."""
    out: Dict[int, List[Tuple[str, torch.Tensor]]] = {}
    storages: Dict[Tuple[bytes, bytes], torch.UntypedStorage] = {}
    for g, layers in handles.groups.items():
        out[g] = []
        for h in layers:
            if h.kind == "cuda_ipc":
                rebuild, args = h.payload
                t = rebuild(*args)
            elif h.kind == "cpu_shm":
                manager, filename, nbytes = h.payload
                st = storages.get((manager, filename))
                if st is None:
                    st = torch.UntypedStorage._new_shared_filename_cpu(manager, filename, nbytes)
                    storages[(manager, filename)] = st
                t = torch.empty(0, dtype=_DTYPES[h.dtype]).set_(
                    st, h.offset, h.shape, h.stride)
            else:
                raise KVHandleError(f"layer {h.name}: unknown handle kind {h.kind!r}")
            if tuple(t.shape) != h.shape or str(t.dtype) != h.dtype:
                raise KVHandleError(f"layer {h.name}: opened as {tuple(t.shape)} {t.dtype}, "
                                    f"expected {h.shape} {h.dtype}")
            out[g].append((h.name, t))
    return out
