"""A planned load checked whole against what it reads and writes, before any copy."""

from __future__ import annotations

from typing import List, Mapping, Tuple

from ..planning.load_batch import Tier
from ..planning.plan import LoadPlan
from .kv_schema import KVLayout
from .load_handle import LoadRejected, MappedStorage


def check_plan(plan: LoadPlan, local: KVLayout,
               storages: Mapping[Tuple[int, Tier], MappedStorage]
               ) -> List[Tuple[MappedStorage, int]]:
    """Raise :class:`LoadRejected` naming the field when a transfer reads a group, storage,
    slot or writes a block that does not exist; returns each transfer's (storage, group)."""
    local_groups = set(local.group_ids)
    out: List[Tuple[MappedStorage, int]] = []
    for t in plan.transfers:
        if t.group not in local_groups:
            raise LoadRejected(f"group: KV-cache group {t.group} unknown locally "
                               f"(groups {sorted(local_groups)})")
        st = storages.get((t.source_rank, t.tier))
        if st is None:
            raise LoadRejected(
                f"rank: no storage mapped for rank {t.source_rank} tier {t.tier.name}")
        slots = st.layout.group(t.group).num_blocks
        if t.rows and int(t.src_slots.max()) >= slots:
            raise LoadRejected(
                f"slot: {int(t.src_slots.max())} out of range [0, {slots}) for rank "
                f"{t.source_rank} {t.tier.name} storage, group {t.group}")
        blocks = local.group(t.group).num_blocks
        if len(t.dst_blocks) and int(t.dst_blocks.max()) >= blocks:
            raise LoadRejected(
                f"dest: block id {int(t.dst_blocks.max())} out of range [0, {blocks}) "
                f"for KV-cache group {t.group}")
        out.append((st, t.group))
    return out
