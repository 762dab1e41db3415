"""Execution of one planned :class:`~.plan.Transfer` with torch (CPU or CUDA).

Every layer tensor is addressed through a *block view*: the block dimension
moved first and the dtype reinterpreted as plain integers (``int64`` words
for contiguous rows, the element-sized integer otherwise).  Copies therefore
move bits, never values: bf16/fp16 NaN payloads survive, and wide words make
``index_select`` a straight memory copy.

A slab layer is a contiguous ``uint8`` buffer ``[rows, block_bytes]``; it is
reinterpreted to match each side's view, so a source stored block-first can
feed a destination whose block dimension is 1 (the per-block logical order is
what :mod:`.kv_schema` compares).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, List, Mapping, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .kv_schema import KVLayout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def block_view(t: torch.Tensor, block_dim: int) -> torch.Tensor:
    """Block-first integer view of ``t`` (no copy; writes go through to ``t``)."""
    v = t.movedim(block_dim, 0) if block_dim else t
    itemsize = v.element_size()
    if v.is_contiguous():
        flat = v.reshape(v.shape[0], math.prod(v.shape[1:]))
        row_bytes = flat.shape[1] * itemsize
        if itemsize < 8 and row_bytes % 8 == 0 and (v.storage_offset() * itemsize) % 8 == 0:
            return flat.view(torch.uint8).view(torch.int64)
        return flat.view(_INT_OF_SIZE[itemsize])
    return v.view(_INT_OF_SIZE[itemsize])


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` as contiguous ``uint8`` rows ``[n, bytes per row]`` (copies only if
    ``t`` is not contiguous)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def slab_as(slab: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The first ``rows`` rows of a ``uint8`` slab viewed with ``like``'s dtype and
    per-block shape (the slab is contiguous, so any such view exists)."""
    return slab[:rows].view(like.dtype).view(rows, *like.shape[1:])


def copy_transfer(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                  slab_layers: Sequence[torch.Tensor], src_slots: torch.Tensor,
                  dst_blocks: torch.Tensor, dst_rows: torch.Tensor,
                  identity_rows: bool) -> None:
    """Copy one transfer for every layer: gather ``src_slots`` into the slab, then
    write slab row ``dst_rows[i]`` into block ``dst_blocks[i]``.

    Layers are block views (:func:`block_view`); index tensors are int64,
    ``src_slots`` on the source's device, the others on the destination's.
    ``identity_rows`` says ``dst_rows == arange(rows)``, which skips a gather.
    """
    rows = int(src_slots.shape[0])
    for src, dst, slab in zip(src_layers, dst_layers, slab_layers):
        if src.device == slab.device:
            torch.index_select(src, 0, src_slots, out=slab_as(slab, rows, src))
        else:  # e.g. CPU tier into a CUDA slab
            slab_as(slab, rows, src).copy_(src.index_select(0, src_slots), non_blocking=True)
        staged = slab_as(slab, rows, dst)
        values = staged if identity_rows else staged.index_select(0, dst_rows)
        dst.index_copy_(0, dst_blocks, values)


def copy_rows(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
               src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every layer (block views, any layouts);
    complete on return for host tensors."""
    if not src_rows:
        return
    si = torch.tensor(list(src_rows), dtype=torch.int64)
    di = torch.tensor(list(dst_rows), dtype=torch.int64)
    for s, d in zip(src, dst):
        rows = as_byte_rows(s.index_select(0, si.to(s.device)))
        d.index_copy_(0, di.to(d.device), slab_as(rows, len(src_rows), d).to(d.device))


def copy_rows_device(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                      src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """The torch fallback of the fused gather (same device, any layouts), on the current
    stream."""
    n = int(src_idx.shape[0])
    for s, d in zip(src, dst):
        rows = as_byte_rows(s.index_select(0, src_idx))
        d.index_copy_(0, dst_idx, slab_as(rows, n, d))


def layer_tensor(item: object) -> torch.Tensor:
    """The tensor of a cache entry given as a tensor or as ``(name, tensor)``."""
    return item[1] if isinstance(item, tuple) else item  # type: ignore[return-value,index]


def block_views(caches: Mapping[int, Sequence[object]],
                layout: KVLayout) -> Dict[int, List[torch.Tensor]]:
    """Block-first integer views of every layer of ``caches``, per group of ``layout``."""
    views: Dict[int, List[torch.Tensor]] = {}
    for g in layout.groups:
        views[g.group] = [block_view(layer_tensor(item), la.block_dim)
                          for item, la in zip(caches[g.group], g.layers)]
    return views
