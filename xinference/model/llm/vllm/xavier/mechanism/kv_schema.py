"""KV layout schema: what a block is, per KV-cache group and layer.

A block is treated as an opaque slice along each layer tensor's *block
dimension* (vLLM's CPU backend: ``[num_blocks, kv_heads, block_size,
2*head]``, dim 0; several CUDA backends: ``[2, num_blocks, ...]``, dim 1).  A
peer's storage may be read into local KV caches only when, for every group
and layer, dtype and per-block shape are equal; the number of blocks may
differ (storage has its own slot count).

The dataclasses are torch-free; :func:`layout_of` inspects tensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence, Tuple, Union

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: THE table of KV dtypes the package stores and moves (name as ``str(torch.dtype)`` ->
#: bytes per element); every other place asks :func:`torch_dtype` / :attr:`block_bytes`
KV_DTYPE_BYTES = {
    "torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.float64": 8,
    "torch.uint8": 1, "torch.int8": 1, "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`KV_DTYPE_BYTES` name; ``SchemaMismatchError`` naming the
    dtype for any other."""
    import torch

    if name not in KV_DTYPE_BYTES:
        raise SchemaMismatchError(f"dtype: unsupported KV dtype {name} (supported: "
                                  f"{', '.join(sorted(KV_DTYPE_BYTES))})")
    dtype = getattr(torch, name.split(".", 1)[1], None)
    if not isinstance(dtype, torch.dtype):
        raise SchemaMismatchError(f"dtype: {name} does not exist in torch {torch.__version__}")
    return dtype


class SchemaMismatchError(ValueError):
    """Two KV layouts cannot exchange blocks; the message names group, layer and field."""


@dataclass(frozen=True)
class LayerLayout:
    """One layer's KV tensor as the package sees it: dtype, block dimension, number of
    blocks, the shape of one block."""
    name: str
    dtype: str
    block_dim: int
    num_blocks: int
    block_shape: Tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        n = KV_DTYPE_BYTES.get(self.dtype)
        if n is None:
            raise SchemaMismatchError(f"dtype: unsupported KV dtype {self.dtype} ({self.name})")
        size = n
        for d in self.block_shape:
            size *= d
        return size


@dataclass(frozen=True)
class GroupLayout:
    """The layers of one KV-cache group (they share block ids)."""
    group: int
    layers: Tuple[LayerLayout, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers of the group."""
        return sum(layer.block_bytes for layer in self.layers)

    @property
    def num_blocks(self) -> int:
        return min(layer.num_blocks for layer in self.layers) if self.layers else 0


@dataclass(frozen=True)
class KVLayout:
    """A replica's KV caches, group by group: two replicas exchange blocks only when their
    layouts are compatible (:meth:`check_compatible` names the first difference).

    ``tp_size``: the replica's tensor-parallel degree; the groups are then one worker's
    shard of them (its KV heads), and only replicas of the same degree exchange blocks."""
    groups: Tuple[GroupLayout, ...]
    tp_size: int = 1

    def group(self, group: int) -> GroupLayout:
        for g in self.groups:
            if g.group == group:
                return g
        raise KeyError(group)

    @property
    def group_ids(self) -> Tuple[int, ...]:
        return tuple(g.group for g in self.groups)

    def fingerprint(self) -> str:
        """Stable hash of what must match between peers (not the block counts)."""
        desc: list = [[g.group, [[la.dtype, la.block_dim, list(la.block_shape)]
                                 for la in g.layers]] for g in self.groups]
        if self.tp_size != 1:
            desc.append(["tp", self.tp_size])
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def check_compatible(self, other: KVLayout, what: str = "peer") -> None:
        """Raise :class:`SchemaMismatchError` unless ``other`` can feed this layout.

        Checks every group of ``self`` exists in ``other`` with the same number
        of layers, dtypes and per-block shapes (layer names and block counts
        may differ).
        """
        if other.tp_size != self.tp_size:
            raise SchemaMismatchError(
                f"{what} schema: tensor_parallel_size {other.tp_size} does not match local "
                f"{self.tp_size} (each worker holds a different shard of the KV heads)")
        theirs = {g.group: g for g in other.groups}
        for mine in self.groups:
            peer = theirs.get(mine.group)
            if peer is None:
                raise SchemaMismatchError(
                    f"{what} schema: KV-cache group {mine.group} missing "
                    f"(has groups {sorted(theirs)})")
            if len(peer.layers) != len(mine.layers):
                raise SchemaMismatchError(
                    f"{what} schema: group {mine.group} has {len(peer.layers)} layers, "
                    f"local has {len(mine.layers)}")
            for la, lb in zip(mine.layers, peer.layers):
                for field in ("dtype", "block_shape"):
                    va, vb = getattr(la, field), getattr(lb, field)
                    if va != vb:
                        raise SchemaMismatchError(
                            f"{what} schema: group {mine.group} layer {la.name}: {field} "
                            f"{vb} does not match local {va}")


LayerTensors = Sequence[Union["torch.Tensor", Tuple[str, "torch.Tensor"]]]


def layout_of(caches: Mapping[int, LayerTensors],
              block_dim: Union[int, Mapping[int, int]] = 0, tp_size: int = 1) -> KVLayout:
    """Layout of ``{group: [tensor | (name, tensor), ...]}`` (one TP worker's shard when
    ``tp_size > 1``).

    ``block_dim`` is one int for all groups or a per-group mapping.
    """
    groups = []
    for gid in sorted(caches):
        dim = block_dim if isinstance(block_dim, int) else block_dim[gid]
        layers = []
        for i, item in enumerate(caches[gid]):
            name, t = item if isinstance(item, tuple) else (f"g{gid}.layer{i}", item)
            if not 0 <= dim < t.dim():
                raise SchemaMismatchError(
                    f"block_dim: {dim} out of range for layer {name} of shape {tuple(t.shape)}")
            shape = tuple(int(s) for s in t.shape)
            layers.append(LayerLayout(
                name=name, dtype=str(t.dtype), block_dim=dim, num_blocks=shape[dim],
                block_shape=_block_shape(t, dim)))
        groups.append(GroupLayout(int(gid), tuple(layers)))
    return KVLayout(tuple(groups), tp_size)


def _block_shape(t: torch.Tensor, block_dim: int) -> Tuple[int, ...]:
    """One block's shape in memory order where a block is one dense range of memory (so a
    storage allocated ``[slots, *block_shape]`` holds the engine's block bytes as they lie,
    and two engines whose caches lie differently in memory are told apart), in logical
    order otherwise."""
    from .block_copy import block_memory_order

    v = t.movedim(block_dim, 0) if block_dim else t
    order = block_memory_order(v)
    dims = order if order is not None else list(range(1, v.dim()))
    return tuple(int(v.shape[d]) for d in dims)
