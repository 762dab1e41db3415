"""vLLM's KV caches as the worker's data plane sees them.

:func:`group_layers` groups vLLM's ``{layer_name: tensor}`` by KV-cache group (layers
sharing one tensor listed once) and finds each group's block dimension (the dimension
of size ``num_blocks``).  The caches stay where vLLM put them: the data plane runs in
the worker process that owns them.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import torch


class KVHandleError(ValueError):
    """The caches cannot be shared; the message says which layer and why."""


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
