"""Blocks of another host's storage, moved with xoscar's ``copy_to``.

The loading rank registers its CPU staging rows as xoscar buffer refs and asks
the source rank's transfer actor to send the requested slots into them; the
source gathers the slots (one contiguous ``uint8`` buffer per layer) and calls
``xo.copy_to`` once for all layers of the transfer.  ``copy_to`` rides the
pools' transport: plain sockets by default, NIXL when the pools use xoscar's
``nixl`` channel (the ``xoscar[nixl]`` extra; GPU machines).  Transfer sizes are
bounded by the slab: one call per planned transfer.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import torch
import xoscar as xo

from .gpu_transfer import RemoteFetch
from .load_batch import Tier
from .plan import Transfer
from .snapshot_storage import SnapshotStorage


def xoscar_fetch(source: Any, local_address: str, tier: Tier) -> RemoteFetch:
    """A :data:`~.gpu_transfer.RemoteFetch` that asks ``source`` (an actor ref exposing
    ``serve_blocks``, e.g. via :func:`serve_blocks`) to write into this process."""

    async def fetch(transfer: Transfer, staging_rows: List[torch.Tensor]) -> None:
        # the views must stay alive until copy_to has written them: they do, in this frame
        refs = [xo.buffer_ref(local_address, rows) for rows in staging_rows]
        await source.serve_blocks(int(tier), transfer.group, transfer.src_slots, refs)

    return fetch


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
