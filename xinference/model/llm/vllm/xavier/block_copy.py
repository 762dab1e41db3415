"""Execution of one planned :class:`~.plan.Transfer` with torch (CPU or CUDA).

``copy_transfer`` gathers the transfer's source slots of every layer into
the slab (``index_select`` into the slab's first ``rows`` rows), then writes
slab rows into destination blocks (``index_copy_`` along the block
dimension).  Layers are addressed through views with the block dimension
moved first, so any layout validated by :mod:`.kv_schema` works.  Bytes are
copied, never converted: bf16 bit patterns are preserved.
"""

from __future__ import annotations

from typing import Sequence

import torch


def block_view(t: torch.Tensor, block_dim: int) -> torch.Tensor:
    """View of ``t`` with the block dimension first (no copy)."""
    return t if block_dim == 0 else t.movedim(block_dim, 0)


def copy_transfer(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                  slab_layers: Sequence[torch.Tensor], src_slots: torch.Tensor,
                  dst_blocks: torch.Tensor, dst_rows: torch.Tensor,
                  identity_rows: bool) -> None:
    """Copy one transfer for every layer.

    All tensors are block-first views; index tensors are int64 on the
    destination's device.  ``identity_rows`` says ``dst_rows == arange``
    (each read has exactly one destination, in order), which skips a gather.
    """
    rows = int(src_slots.shape[0])
    for src, dst, slab in zip(src_layers, dst_layers, slab_layers):
        staged = slab[:rows]
        if src.device != staged.device:
            idx = src_slots.to(src.device)
            staged.copy_(src.index_select(0, idx), non_blocking=True)
        else:
            torch.index_select(src, 0, src_slots, out=staged)
        values = staged if identity_rows else staged.index_select(0, dst_rows)
        dst.index_copy_(0, dst_blocks, values)
