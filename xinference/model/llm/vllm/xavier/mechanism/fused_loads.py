"""Which transfers of a load engine take the fused Triton gather-scatter, and their launch.

One answer per (source rank, tier, group), kept until the mappings change; the pointer
tables of a storage's group and of the local caches are built once (:mod:`.block_copy_triton`).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..planning.counters import CounterSink
from ..planning.load_batch import Tier
from ..planning.plan import Transfer
from . import block_copy_triton
from .load_handle import LoadRejected, MappedStorage


class FusedLoads:
    """The fused copies of one :class:`~.gpu_transfer.GPUTransfer` (``copy_kernel``:
    ``auto``, ``torch`` or ``triton``, as it was given)."""

    def __init__(self, copy_kernel: str, sink: CounterSink) -> None:
        self.copy_kernel = copy_kernel
        self._sink = sink
        self._applies: Dict[Tuple[int, Tier, int], bool] = {}
        self._local_tables: Dict[int, torch.Tensor] = {}

    def forget(self, local_caches: bool = False) -> None:
        """Drop the answers (mappings changed), and the local caches' tables too."""
        self._applies.clear()
        if local_caches:
            self._local_tables.clear()

    def applies(self, st: MappedStorage, group: int, local: List[torch.Tensor]) -> bool:
        """Whether ``st``'s ``group`` is copied into ``local`` by the fused kernel; raises
        :class:`~.load_handle.LoadRejected` (before any copy) when ``copy_kernel`` is
        ``triton`` and it does not apply."""
        key = (st.rank, st.tier, group)
        ok = self._applies.get(key)
        if ok is None:
            ok = st.fetch is None and self.copy_kernel != "torch" and block_copy_triton.supports(
                st.layers[group], local)
            self._applies[key] = ok
        if not ok and self.copy_kernel == "triton":
            raise LoadRejected("copy_kernel: the fused Triton kernel does not apply to rank "
                               f"{st.rank} {st.tier.name} group {group} (needs contiguous "
                               "block-first CUDA layers)")
        return ok

    def run(self, st: MappedStorage, t: Transfer, local: List[torch.Tensor],
            src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """Launch ``t`` on the current stream: ``local[dst_idx[i]] = src[src_idx[i]]``."""
        src = st.layers[t.group]
        src_table = st.pointer_tables.get(t.group)
        if src_table is None:
            src_table = st.pointer_tables[t.group] = block_copy_triton.pointer_table(src)
        dst_table = self._local_tables.get(t.group)
        if dst_table is None:
            dst_table = self._local_tables[t.group] = block_copy_triton.pointer_table(local)
        block_copy_triton.gather_scatter(
            src_table, dst_table, len(local), int(local[0].shape[1]), src[0].stride(0),
            local[0].stride(0), src_idx, dst_idx)
        self._sink.add("fused_transfers")
