"""Persistent, bounded staging slabs for block transfers.

A slab of ``rows`` blocks for a KV-cache group is one contiguous ``uint8``
tensor per layer shaped ``[rows, block_bytes]``: a transfer gathers up to ``rows`` source blocks
into it, then scatters them into the destination caches.  Slabs bound the
memory a transfer needs and give every wire transfer a fixed shape.

The small slab of each group is allocated on first use and kept; the full
slab is allocated on first use and released by :meth:`SlabPool.release_full`
or :meth:`SlabPool.close`.  Nothing is allocated per transfer.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .kv_schema import GroupLayout, KVLayout


class SlabPool:
    """Reusable staging slabs per group and size (full or small), allocated on first use."""
    def __init__(self, layout: KVLayout, full_rows: int, small_rows: int,
                 device: torch.device) -> None:
        self._layout = layout
        self._full_rows = full_rows
        self._small_rows = small_rows
        self._device = device
        self._slabs: Dict[Tuple[int, int], List[torch.Tensor]] = {}
        self._closed = False

    def get(self, group: int, rows: int) -> List[torch.Tensor]:
        """Per-layer slab tensors of ``rows`` rows (``rows`` is the full or small size)."""
        if self._closed:
            raise RuntimeError("slab pool is closed")
        if rows not in (self._full_rows, self._small_rows):
            raise ValueError(f"slab rows {rows}: expected {self._full_rows} or {self._small_rows}")
        slab = self._slabs.get((group, rows))
        if slab is None:
            slab = self._allocate(self._layout.group(group), rows)
            self._slabs[(group, rows)] = slab
        return slab

    def _allocate(self, group: GroupLayout, rows: int) -> List[torch.Tensor]:
        return [torch.empty((rows, layer.block_bytes), dtype=torch.uint8, device=self._device)
                for layer in group.layers]

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._slabs.values() for t in ts)

    def release_full(self) -> None:
        for key in [k for k in self._slabs if k[1] == self._full_rows]:
            del self._slabs[key]

    def close(self) -> None:
        self._slabs.clear()
        self._closed = True
