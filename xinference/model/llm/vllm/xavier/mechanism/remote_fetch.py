"""Blocks of another host's storage, moved with xoscar's ``copy_to``.

The loading rank's transfer actor registers staging rows as xoscar buffer refs and asks
the source rank's transfer actor to send the requested slots into them
(:func:`fetch_into`); the source gathers the slots (one contiguous ``uint8`` buffer per
layer) and calls ``xo.copy_to`` once for all layers of the transfer (:func:`serve_blocks`).
``copy_to`` picks its channel from the address in the buffer refs: NIXL for a ``nixl://``
address (:mod:`.nixl_endpoint`), the pools' sockets otherwise.  The staging rows live in
shared memory that the loading worker maps too: it writes them into its KV cache once the
fetch returned.  Transfer sizes are bounded by the slab: one call per planned transfer.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
import xoscar as xo

from ..planning.load_batch import Tier
from .kv_schema import KVLayout
from .snapshot_storage import ShmHandles, SnapshotStorage, new_shm_tensor


async def fetch_into(source: Any, address: str, tier: int, group: int, slots: Sequence[int],
                     staging_rows: List[torch.Tensor], tp_rank: int = 0) -> int:
    """Loader side: have ``source`` (an actor ref exposing ``serve_blocks``) write
    ``slots`` of its shard ``tp_rank``'s ``tier``/``group`` into ``staging_rows`` (per
    layer ``uint8`` ``[len(slots), block_bytes]``), received at ``address``.  Returns the
    bytes moved."""
    # the rows must stay alive until copy_to has written them: they do, in this frame
    refs = [xo.buffer_ref(address, rows) for rows in staging_rows]
    return int(await source.serve_blocks(int(tier), int(group), list(slots), refs,
                                         int(tp_rank)))


async def serve_blocks(storage: SnapshotStorage, tier: int, group: int,
                       slots: Sequence[int], refs: Sequence[Any]) -> int:
    """Source side: send ``slots`` of ``tier``/``group`` into the loader's buffer refs.
    Returns the bytes sent."""
    slot_list = slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
    rows = storage.gather_rows(Tier(tier), group, slot_list)
    if len(rows) != len(refs):
        raise ValueError(f"refs: expected one buffer per layer ({len(rows)}), got {len(refs)}")
    await xo.copy_to(rows, list(refs))
    return sum(r.numel() for r in rows)


class StagingRows:
    """Per group and layer ``uint8 [rows, block_bytes]`` in shared memory: where reads from
    other hosts land for the worker, which maps them through :attr:`handles`.  Allocated
    by the rank's transfer actor; the files go on :meth:`close` (idempotent)."""

    def __init__(self, layout: KVLayout, rows: int) -> None:
        self.rows: Dict[int, List[torch.Tensor]] = {}
        self.handles: ShmHandles = {}
        self._files: List[str] = []
        try:
            for g in layout.groups:
                self.rows[g.group], self.handles[g.group] = [], []
                for la in g.layers:
                    shape = (rows, la.block_bytes)
                    path, t = new_shm_tensor(shape, torch.uint8)
                    self._files.append(path)
                    self.rows[g.group].append(t)
                    self.handles[g.group].append((path, str(t.dtype), shape))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.rows = {}
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files = []
