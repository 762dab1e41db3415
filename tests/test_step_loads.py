"""One step's loads built array by array (planning/step_loads.py): the same rows, null
positions and leases as the row-by-row construction they replaced, and the same requests
dropped for block names whose low 63 bits clash."""

from typing import Dict, List, Set, Tuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from xinference.model.llm.vllm.xavier.planning.block_names import row_key
from xinference.model.llm.vllm.xavier.planning.directory_types import Location
from xinference.model.llm.vllm.xavier.planning.load_batch import BlockLoad, Tier
from xinference.model.llm.vllm.xavier.planning.step_loads import (
    StepLoad,
    hit_rows,
    name_clashes,
)


def rows_one_by_one(keys, first, locations, n, block_ids, null, tp):
    """The construction of session 24's ``SchedulerSide.allocated`` (the reference)."""
    rows, names, lease, skipped = [], [], [], 0
    per_group = len(locations) // len(keys)
    for g in range(per_group):
        for j in range(n):
            loc = locations[g * len(keys) + j]
            pos = first + j
            group, shard = divmod(loc.group, tp)
            if pos >= len(block_ids[group]) or null[group][pos]:
                skipped += shard == 0
                continue
            if loc.tier != Tier.VLLM:
                lease.append(tuple(loc))
            rows.append(BlockLoad(loc.group, row_key(keys[j]), loc.rank, loc.tier, loc.slot,
                                  int(block_ids[group][pos]), loc.generation,
                                  loc.incarnation).as_row())
            names.append(keys[j])
    return rows, names, lease, skipped


@st.composite
def hits(draw):
    groups, tp = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    n_keys = draw(st.integers(1, 12))
    keys = tuple(draw(st.integers(1, 2**192 - 1)) for _ in range(n_keys))
    first = draw(st.integers(0, 4))
    locations = [Location(draw(st.integers(0, 5)), draw(st.sampled_from(list(Tier))),
                          g * tp + s, draw(st.integers(0, 999)), draw(st.integers(1, 9)),
                          draw(st.integers(0, 3)))
                 for g in range(groups) for s in range(tp) for _ in range(n_keys)]
    block_ids = [draw(st.lists(st.integers(1, 500), max_size=first + n_keys + 2))
                 for _ in range(groups)]
    null = [[draw(st.integers(0, 4)) == 0 for _ in b] for b in block_ids]
    return keys, first, locations, draw(st.integers(0, n_keys)), block_ids, null, tp


@settings(max_examples=200, deadline=None)
@given(hits())
def test_rows_equal_the_row_by_row_construction(hit):
    keys, first, locations, n, block_ids, null, tp = hit
    table = np.array([tuple(x) for x in locations], np.int64)
    load, skipped = hit_rows("r", keys, first, table, n, block_ids, null, tp)
    rows, names, lease, ref_skipped = rows_one_by_one(keys, first, locations, n, block_ids,
                                                      null, tp)
    assert load.rows.tolist() == [list(r) for r in rows]
    assert [load.names[i] for i in load.name_of_row.tolist()] == names
    assert [tuple(r) for r in load.lease_rows.tolist()] == lease
    assert skipped == ref_skipped


def clashes_one_by_one(loads: List[Tuple[List[Tuple[int, int]], List[int]]]) -> Set[int]:
    seen: Dict[Tuple[int, int], int] = {}
    clashed: Set[int] = set()
    for i, (pairs, names) in enumerate(loads):
        mine: Dict[Tuple[int, int], int] = {}
        for gk, name in zip(pairs, names):
            if seen.get(gk, name) != name or mine.setdefault(gk, name) != name:
                clashed.add(i)
                break
        else:
            seen.update(mine)
    return clashed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 2)),
                         max_size=6), max_size=5))
def test_clashes_equal_the_row_by_row_check(requests):
    """Names drawn so that low 63 bits often repeat, under equal or different names:
    ``(group, low, high)`` is the name ``high << 63 | low`` in ``group``."""
    loads, ref = [], []
    for i, req in enumerate(requests):
        names = tuple((high << 63) | low for _, low, high in req)
        rows = np.zeros((len(req), 8), np.int64)
        rows[:, 0] = [g for g, _, _ in req]
        rows[:, 1] = [row_key(x) for x in names]
        loads.append(StepLoad(f"r{i}", rows, names, np.arange(len(req)), rows[:0, :6]))
        ref.append(([(g, row_key(x)) for (g, _, _), x in zip(req, names)], list(names)))
    assert name_clashes(loads) == clashes_one_by_one(ref)


def test_a_clash_is_found_and_the_first_name_keeps_its_loads():
    low = 12345
    a, b = (1 << 63) | low, (2 << 63) | low  # different names, equal low 63 bits
    rows = np.zeros((1, 8), np.int64)
    rows[0, 1] = low
    loads = [StepLoad("a", rows, (a,), np.zeros(1, np.int64), rows[:0, :6]),
             StepLoad("b", rows.copy(), (b,), np.zeros(1, np.int64), rows[:0, :6]),
             StepLoad("c", rows.copy(), (a,), np.zeros(1, np.int64), rows[:0, :6])]
    assert name_clashes(loads) == {1}
