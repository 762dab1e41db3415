"""Execution of one planned :class:`~..planning.plan.Transfer` with torch (CPU or CUDA).

Every layer tensor is addressed through a *block view*: the block dimension
moved first and the dtype reinterpreted as plain integers (``int64`` words
for contiguous rows, the element-sized integer otherwise).  Copies therefore
move bits, never values: bf16/fp16 NaN payloads survive, and wide words make
``index_select`` a straight memory copy.

A slab layer is a contiguous ``uint8`` buffer ``[rows, block_bytes]``; it is
reinterpreted to match each side's view, so a source stored block-first can
feed a destination whose block dimension is 1 (the per-block order is what
:mod:`.kv_schema` compares: a block's memory order where a block is one dense range
of memory, as in vLLM's permuted CUDA caches, its logical order otherwise).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .kv_schema import KVLayout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def block_memory_order(v: torch.Tensor) -> Optional[List[int]]:
    """The dimensions after the first (blocks) of ``v`` in memory order (outermost first)
    when every block is one dense range of memory, else None.  A contiguous tensor gives
    ``[1, 2, ...]``; vLLM's permuted caches (a logical ``[blocks, heads, tokens, 2*head]``
    stored as ``[blocks, tokens, heads, 2*head]``, say) give their physical order."""
    dims = sorted(range(1, v.dim()), key=lambda d: v.stride(d), reverse=True)  # stable
    expected = 1
    for d in reversed(dims):
        if v.shape[d] == 1:
            continue
        if v.stride(d) != expected:
            return None
        expected *= v.shape[d]
    if v.shape[0] > 1 and v.stride(0) < expected:
        return None
    return dims


def block_view(t: torch.Tensor, block_dim: int) -> torch.Tensor:
    """Block-first integer view of ``t`` (no copy; writes go through to ``t``): one row
    per block, its bytes in memory order, when every block is one dense range of memory
    (contiguous or permuted within the block: :func:`block_memory_order`); otherwise the
    block dimension moved first with the element-sized integer type."""
    v = t.movedim(block_dim, 0) if block_dim else t
    itemsize = v.element_size()
    if block_memory_order(v) is not None:
        row = math.prod(v.shape[1:])
        flat = v.as_strided((v.shape[0], row), (v.stride(0) if v.shape[0] > 1 else row, 1))
        if (itemsize < 8 and (row * itemsize) % 8 == 0
                and (flat.stride(0) * itemsize) % 8 == 0
                and (v.storage_offset() * itemsize) % 8 == 0):
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


def indices_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied from page-locked memory on the
    current stream (the host does not wait for the stream)."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def gather_to_pinned(src: Sequence[torch.Tensor], rows: Sequence[int],
                     device: torch.device) -> List[torch.Tensor]:
    """Queue on the current stream: rows ``rows`` of every layer of ``src`` (CUDA block
    views) into new page-locked ``uint8`` rows ``[len(rows), bytes per row]`` per layer;
    their contents are valid once the stream has passed this point."""
    idx = indices_on(rows, device)
    host = [torch.empty((len(rows), as_byte_rows(s[:1]).shape[1]), dtype=torch.uint8,
                        pin_memory=True) for s in src]
    for s, h in zip(src, host):
        h.copy_(as_byte_rows(s.index_select(0, idx)), non_blocking=True)
    return host


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
