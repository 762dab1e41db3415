"""What a vLLM worker's process holds on its GPU, as torch's caching allocator counts it.

One figure per worker, the same for a worker with or without Xavier, so that a benchmark
can report the device memory Xavier adds to a replica beyond vLLM's own: the difference of
``max_reserved`` between a Xavier replica and a plain one with the same KV cache (the GPU
snapshot tier, load slabs, victims' copies and any transient of the load path are all
allocations of the same process through the same allocator).  Memory a peer maps with CUDA
IPC is the source's and is not counted again.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable

import torch


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: Dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _kv_cache_tensors(worker: Any) -> Iterable[torch.Tensor]:
    runner = getattr(worker, "model_runner", None)
    caches = getattr(runner, "kv_caches", None) or []
    for c in caches:  # a tensor per layer (some backends: a list of tensors per layer)
        yield from (c if isinstance(c, (list, tuple)) else [c])


def device_memory(worker: Any) -> Dict[str, int]:
    """``reserved`` / ``max_reserved`` / ``allocated`` bytes of this process's CUDA device
    (zero on vLLM's CPU build, or in a process that never touched CUDA) and
    ``kv_cache_bytes``: vLLM's own KV cache tensors of ``worker`` (0 for ``None``)."""
    out = {"reserved": 0, "max_reserved": 0, "allocated": 0,
           "kv_cache_bytes": _unique_bytes(_kv_cache_tensors(worker))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        out.update(reserved=int(torch.cuda.memory_reserved(device)),
                   max_reserved=int(torch.cuda.max_memory_reserved(device)),
                   allocated=int(torch.cuda.memory_allocated(device)))
    return out


class DeviceMemoryProbe:
    """A ``worker_extension_cls`` for plain vLLM replicas (no connector): only adds
    :meth:`xavier_device_memory`, the method Xavier's own worker extension has too."""

    def xavier_device_memory(self) -> Dict[str, int]:
        return device_memory(self)
