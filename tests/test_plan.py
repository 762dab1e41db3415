"""Pure planning: exhaustive properties against a dict-based reference model."""

import math
from collections import Counter
from typing import Dict, List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xinference.model.llm.vllm.xavier.planning.load_batch import NULL_BLOCK_ID, BlockLoad, LoadBatch
from xinference.model.llm.vllm.xavier.planning.plan import (
    ConflictingWriteError,
    PeerSlabState,
    SlabConfig,
    SlabState,
    plan_step,
)

CFG = SlabConfig(full_rows=16, small_rows=4, switch_after=2)


def identity(rank: int, slot: int, restarted: bool = False) -> Tuple[int, int]:
    """The (generation, incarnation) a source row names: a generation per slot, one
    incarnation per rank, or two (``restarted``: the rank restarted between two lookups
    of one step, odd slots named by the new storage)."""
    return 3 * slot + 1, 100 + 2 * rank + (slot % 2 if restarted else 0)


def batch_of(*requests: List[Tuple[int, int, int, int, int, int]],
             restarted: bool = False) -> LoadBatch:
    return LoadBatch.from_requests(
        (f"r{i}", [BlockLoad(*row, *identity(row[2], row[4], restarted)) for row in rows])
        for i, rows in enumerate(requests))


# ---------------------------------------------------------------- reference model
def reference(batch: LoadBatch, cfg: SlabConfig, peers: Dict[int, Tuple[int, bool]]):
    rows = [tuple(int(v) for v in r) for r in batch.table]
    live = [(i, r) for i, r in enumerate(rows) if r[5] != NULL_BLOCK_ID]
    dest_key: Dict[Tuple[int, int], int] = {}
    for _, (g, k, _r, _t, _s, d, _gen, _inc) in live:
        if dest_key.setdefault((g, d), k) != k:
            return None  # conflict
    source: Dict[Tuple[int, int], Tuple[Tuple[int, int], tuple]] = {}
    for i, r in live:
        key, cand = (r[0], r[1]), (r[3], i)
        if key not in source or cand < source[key][0]:
            source[key] = (cand, r)
    per_rank = Counter(r[2] for _, r in source.values())
    slab, nxt = {}, dict(peers)
    for rank, n in per_rank.items():
        count, small = peers.get(rank, (0, False))
        if n > cfg.small_rows:
            count, small = 0, False
        else:
            count += 1
            small = small or count >= cfg.switch_after
        nxt[rank] = (count, small)
        slab[rank] = cfg.small_rows if small else cfg.full_rows
    buckets = Counter((r[2], r[3], r[0], r[7]) for _, r in source.values())
    transfers = {b: math.ceil(n / slab[b[0]]) for b, n in buckets.items()}
    padded = sum(transfers[b] * slab[b[0]] - n for b, n in buckets.items())
    return dict(dest_key=dest_key, source=source, buckets=buckets, transfers=transfers,
                padded=padded, slab=slab, next=nxt,
                dropped=len(rows) - len(live))


@st.composite
def batches(draw):
    n_groups = draw(st.integers(1, 2))
    keys = draw(st.lists(st.integers(1, 2**62), min_size=1, max_size=12, unique=True))
    n_dest = draw(st.integers(1, 40))
    # per group: a function dest -> key (no conflicts) ...
    mapping = {(g, d): draw(st.sampled_from(keys))
               for g in range(n_groups) for d in range(1, n_dest + 1)}
    requests = []
    for _ in range(draw(st.integers(0, 6))):
        rows = []
        for _ in range(draw(st.integers(0, 30))):
            g = draw(st.integers(0, n_groups - 1))
            d = draw(st.integers(0, n_dest))
            k = mapping[(g, d)] if d else draw(st.sampled_from(keys))  # null: any key
            rows.append((g, k, draw(st.integers(0, 3)), draw(st.integers(0, 1)),
                         draw(st.integers(0, 1000)), d))
        requests.append(rows)
    # ... unless asked for one conflict
    if draw(st.booleans()) and requests and requests[0] and len(keys) > 1:
        g, k, r, t, s, d = requests[0][0]
        if d:
            other = next(x for x in keys if x != k)
            requests[-1] = requests[-1] + [(g, other, r, t, s, d)]
    return batch_of(*requests, restarted=True)


@settings(max_examples=300, deadline=None)
@given(batches(), st.lists(st.integers(0, 3), max_size=4), st.booleans())
def test_plan_matches_reference(batch, small_ranks, start_small):
    peers = {r: (1, start_small) for r in small_ranks}
    state = SlabState({r: PeerSlabState(c, s) for r, (c, s) in peers.items()})
    ref = reference(batch, CFG, peers)
    if ref is None:
        with pytest.raises(ConflictingWriteError):
            plan_step(batch, CFG, state)
        return
    plan, nxt = plan_step(batch, CFG, state)
    assert plan.dropped_null == ref["dropped"]
    # every live destination written exactly once, with the right key's source row
    written = {}
    for t in plan.transfers:
        assert t.rows <= t.slab_rows == ref["slab"][t.source_rank]
        assert t.src_slots.dtype == np.int64 and t.dst_blocks.dtype == np.int64
        assert np.all((t.dst_rows >= 0) & (t.dst_rows < t.rows))
        # each read carries the identity its row was promised; one incarnation per transfer
        assert t.src_generations is not None and len(t.src_generations) == t.rows
        for slot, gen in zip(t.src_slots.tolist(), t.src_generations.tolist()):
            assert (gen, t.incarnation) == identity(t.source_rank, slot, restarted=True)
        for d, row in zip(t.dst_blocks.tolist(), t.dst_rows.tolist()):
            assert (t.group, d) not in written
            written[(t.group, d)] = (t.source_rank, int(t.tier), int(t.src_slots[row]))
    assert set(written) == set(ref["dest_key"])
    for (g, d), k in ref["dest_key"].items():
        _, (_, _, r, ti, s, _, _, _) = ref["source"][(g, k)]
        assert written[(g, d)] == (r, ti, s)
    # reads: each (group, key) once; transfer counts and padding exact
    assert plan.rows == len(ref["source"])
    got = Counter((t.source_rank, int(t.tier), t.group, t.incarnation) for t in plan.transfers)
    assert dict(got) == ref["transfers"]
    assert plan.padded_rows == ref["padded"]
    assert plan.blocks_written == len(ref["dest_key"])
    assert {r: (p.consecutive_small, p.use_small) for r, p in nxt.peers.items()} == ref["next"]
    for g, dests in plan.written.items():
        assert dests.tolist() == sorted(d for (gg, d) in ref["dest_key"] if gg == g)


def test_conflict_names_destination_keys_and_requests():
    b = batch_of([(0, 111, 1, 0, 5, 7)], [(0, 222, 2, 0, 6, 7)])
    with pytest.raises(ConflictingWriteError) as ei:
        plan_step(b, CFG)
    msg = str(ei.value)
    assert "destination block 7" in msg and "111" in msg and "222" in msg
    assert "r0" in msg and "r1" in msg and "group 0" in msg


def test_same_dest_in_two_groups_is_not_a_conflict():
    plan, _ = plan_step(batch_of([(0, 1, 1, 0, 5, 7), (1, 2, 1, 0, 6, 7)]), CFG)
    assert plan.blocks_written == 2


def test_null_blocks_dropped_before_conflict_check():
    b = batch_of([(0, 1, 1, 0, 5, NULL_BLOCK_ID), (0, 2, 1, 0, 6, NULL_BLOCK_ID),
                  (0, 3, 1, 0, 7, 4)])
    plan, _ = plan_step(b, CFG)
    assert plan.dropped_null == 2 and plan.rows == 1 and plan.blocks_written == 1


def test_identical_mapping_from_two_ranks_reads_once():
    b = batch_of([(0, 9, 1, 0, 5, 3)], [(0, 9, 2, 0, 8, 3)])
    plan, _ = plan_step(b, CFG)
    assert len(plan.transfers) == 1 and plan.rows == 1 and plan.blocks_written == 1
    assert plan.transfers[0].source_rank == 1
    assert plan.redundant_reads == 1


def test_gpu_tier_preferred_over_cpu_tier():
    b = batch_of([(0, 9, 1, 1, 5, 3)], [(0, 9, 2, 0, 8, 3)])
    plan, _ = plan_step(b, CFG)
    (t,) = plan.transfers
    assert (t.source_rank, int(t.tier), t.src_slots.tolist()) == (2, 0, [8])


def test_one_key_many_destinations_one_read():
    b = batch_of([(0, 9, 1, 0, 5, 3), (0, 9, 1, 0, 5, 4)], [(0, 9, 1, 0, 5, 6)])
    plan, _ = plan_step(b, CFG)
    (t,) = plan.transfers
    assert t.rows == 1 and t.dst_blocks.tolist() == [3, 4, 6] and t.dst_rows.tolist() == [0, 0, 0]


def _small(rank: int, n: int, base: int) -> LoadBatch:
    return batch_of([(0, base + i, rank, 0, i, 1 + i) for i in range(n)])


def test_inherited_full_small_small_sequence():
    state = SlabState()
    seen = []
    for step in range(3):
        plan, state = plan_step(_small(1, 3, 100 * step), CFG, state)
        seen.append(plan.transfers[0].slab_rows)
    assert seen == [16, 4, 4]
    plan, state = plan_step(_small(1, 10, 1000), CFG, state)  # large: back to full
    assert plan.transfers[0].slab_rows == 16
    seen = []
    for step in range(2):
        plan, state = plan_step(_small(1, 2, 2000 + 100 * step), CFG, state)
        seen.append(plan.transfers[0].slab_rows)
    assert seen == [16, 4]


def test_mixed_large_and_small_peers_respect_their_bounds():
    state = SlabState()
    for step in range(2):  # rank 2 becomes small
        _, state = plan_step(_small(2, 2, 10 * step), CFG, state)
    big = [(0, 5000 + i, 1, 0, i, 1 + i) for i in range(37)]
    small = [(0, 9000 + i, 2, 0, i, 100 + i) for i in range(3)]
    plan, state = plan_step(batch_of(big, small), CFG, state)
    by_rank = {}
    for t in plan.transfers:
        assert t.rows <= t.slab_rows
        by_rank.setdefault(t.source_rank, []).append((t.rows, t.slab_rows))
    assert by_rank == {1: [(16, 16), (16, 16), (5, 16)], 2: [(3, 4)]}
    assert plan.padded_rows == 11 + 1


def test_slab_config_validation_names_field():
    with pytest.raises(ValueError, match="full_rows"):
        SlabConfig(full_rows=0)
    with pytest.raises(ValueError, match="small_rows"):
        SlabConfig(full_rows=8, small_rows=9)
    with pytest.raises(ValueError, match="switch_after"):
        SlabConfig(switch_after=0)


@st.composite
def distinct_row_steps(draw):
    """Steps of the common kind: distinct (group, key) and (group, destination) pairs, no
    null block, from one or several (source rank, tier, group) buckets; several requests;
    up to 12 full slabs (the fast path takes steps of any size)."""
    n = draw(st.integers(1, 200))
    keys = draw(st.lists(st.integers(1, 2**40), min_size=n, max_size=n, unique=True))
    dests = draw(st.lists(st.integers(1, 900), min_size=n, max_size=n, unique=True))
    slots = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    buckets = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 1), st.integers(0, 1)),
                            min_size=1, max_size=4))
    which = draw(st.lists(st.integers(0, len(buckets) - 1), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    rows = [(buckets[b][2], k, buckets[b][0], buckets[b][1], s, d)
            for k, s, d, b in zip(keys, slots, dests, which)]
    bounds = [0] + cuts + [n]
    return batch_of(*[rows[a:b] for a, b in zip(bounds, bounds[1:])])


@settings(max_examples=300, deadline=None)
@given(distinct_row_steps(), st.integers(0, 3))
def test_the_distinct_rows_fast_path_makes_the_same_copies_as_the_general_path(batch, small):
    from xinference.model.llm.vllm.xavier.planning.plan import (
        _plan_distinct_rows,
        _plan_general,
    )

    state = SlabState({int(batch.table[0][2]): PeerSlabState(small, small >= 2)})
    fast = _plan_distinct_rows(batch, CFG, state)
    assert fast is not None
    (fp, fs), (gp, gs) = fast, _plan_general(batch, CFG, state)
    assert fs == gs
    assert [(t.source_rank, t.tier, t.group, t.slab_rows, t.rows) for t in fp.transfers] == \
        [(t.source_rank, t.tier, t.group, t.slab_rows, t.rows) for t in gp.transfers]

    def copies(plan):
        return sorted((t.source_rank, int(t.tier), t.group, int(t.src_slots[r]), int(d))
                      for t in plan.transfers for r, d in zip(t.dst_rows, t.dst_blocks))

    assert copies(fp) == copies(gp)

    def identities(plan):  # what the loader checks after the copy, per copy
        return sorted((t.source_rank, int(t.tier), t.group, t.incarnation,
                       int(t.src_slots[r]), int(t.src_generations[r]))
                      for t in plan.transfers for r in t.dst_rows)

    assert identities(fp) == identities(gp)
    assert {g: v.tolist() for g, v in fp.written.items()} == \
        {g: v.tolist() for g, v in gp.written.items()}
    assert (fp.padded_rows, fp.blocks_written, fp.request_ids) == \
        (gp.padded_rows, gp.blocks_written, gp.request_ids)
    assert all(t.identity_rows for t in fp.transfers)


def test_steps_of_another_kind_take_the_general_path():
    from xinference.model.llm.vllm.xavier.planning.plan import _plan_distinct_rows

    one_key_twice = batch_of([(0, 1, 1, 0, 5, 10), (0, 1, 2, 1, 6, 11)])  # read once
    null = batch_of([(0, 1, 1, 0, 5, NULL_BLOCK_ID)])
    same_dest = batch_of([(0, 1, 1, 0, 5, 10)], [(0, 1, 1, 0, 5, 10)])
    for b in (one_key_twice, null, same_dest):
        assert _plan_distinct_rows(b, CFG, SlabState()) is None
    # the same key and destination id in two KV-cache groups are two distinct blocks
    two_groups = batch_of([(0, 1, 1, 0, 5, 10), (1, 1, 1, 0, 5, 10)])
    assert _plan_distinct_rows(two_groups, CFG, SlabState()) is not None
