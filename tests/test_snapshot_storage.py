"""Snapshot storage with the block directory and the load engine, in one process.

(The same flow across real processes is in test_storage_multiprocess.py.)
"""

import asyncio
import os

import pytest
import torch

from xinference.model.llm.vllm.xavier.block_copy import block_view
from xinference.model.llm.vllm.xavier.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.gpu_transfer import GPUTransfer, Lease
from xinference.model.llm.vllm.xavier.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.load_batch import Tier
from xinference.model.llm.vllm.xavier.plan import SlabConfig
from xinference.model.llm.vllm.xavier.slot_allocator import SlotAllocator
from xinference.model.llm.vllm.xavier.snapshot_storage import (
    LocalDirectory,
    SnapshotStorage,
    TierConfig,
    open_shm,
)

from .kvfixtures import BLOCK_DIM, bits, loads, make_caches

N_BLOCKS = 32
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")  # engine caches and the GPU tier


def world(seed=0):
    gen = torch.Generator().manual_seed(seed)
    a_cache = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)  # replica A's engine KV cache
    b_cache = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)  # replica B's
    layout = layout_of(a_cache, BLOCK_DIM)
    views = {g: [block_view(t, BLOCK_DIM[g]) for t in ts] for g, ts in a_cache.items()}
    return a_cache, b_cache, layout, views


def block_of(cache, g, i):
    return [t.select(BLOCK_DIM[g], i) for t in cache[g]]


def storage(layout, directory, gpu_blocks, cpu_blocks=0, shared=False, pin=False):
    per_block = max(g.block_bytes for g in layout.groups) * len(layout.groups)
    tiers = [TierConfig(Tier.GPU, gpu_blocks * per_block, device=DEVICE)]
    if cpu_blocks:
        tiers.append(TierConfig(Tier.CPU, cpu_blocks * per_block, shared_memory=shared,
                                pin=pin))
    return SnapshotStorage(1, layout, tiers, directory)


async def load_on_b(d: BlockDirectory, st: SnapshotStorage, b_cache, keys, dests, group=0):
    """Replica B asks the directory and loads what it gets, leases released after."""
    res = d.query(group, keys, exclude_rank=2)
    eng = GPUTransfer(2, SlabConfig(8, 2, 2),
                      release_lease=lambda lease: _release(d, lease))
    await eng.set_local_caches(b_cache, BLOCK_DIM)
    for tier in (Tier.GPU, Tier.CPU):
        try:
            await eng.map_storage(1, tier, st.caches(tier))
        except KeyError:
            pass
    rows = [(group, k, loc.rank, loc.tier, loc.slot, dest)
            for k, loc, dest in zip(res.keys, res.locations, dests)]
    await eng.load_gpu_requests_v1(loads([rows]),
                                   [Lease(i, 1) for i in res.lease_ids])
    await eng.close()
    return res


async def _release(d, lease):
    d.release([lease.lease_id])


def assert_block_equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(bits(a.cpu()), bits(b.cpu()))


def test_export_then_query_then_load_bit_exact():
    a_cache, b_cache, layout, views = world()
    d = BlockDirectory()

    async def run():
        st = storage(layout, LocalDirectory(d), gpu_blocks=8)
        r = await st.export(views, [(0, 100 + i, 3 + i) for i in range(5)] + [(1, 7, 9)])
        assert r.exported == 6 and d.num_blocks == 6
        again = await st.export(views, [(0, 100, 3)])
        assert again.already_stored == 1 and again.exported == 0
        twice = await st.export(views, [(0, 200, 1), (0, 200, 1)])  # one block named twice
        assert twice.exported == 1 and st.used(Tier.GPU) == 7
        res = await load_on_b(d, st, b_cache, [100, 101, 102, 103, 104, 999], [20, 21, 22, 23, 24])
        assert res.num_hits == 5
        return st

    st = asyncio.run(run())
    for i in range(5):
        assert_block_equal(block_of(b_cache, 0, 20 + i), block_of(a_cache, 0, 3 + i))
    assert d.outstanding_leases == 0
    st.close()
    st.close()


def test_eviction_never_reuses_a_leased_slot():
    a_cache, b_cache, layout, views = world(1)
    d = BlockDirectory()

    async def run():
        st = storage(layout, LocalDirectory(d), gpu_blocks=3)
        await st.export(views, [(0, 1, 1), (0, 2, 2), (0, 3, 3)])
        held = d.query(0, [1], exclude_rank=2)  # a peer is about to read key 1
        r = await st.export(views, [(0, 4, 4), (0, 5, 5), (0, 6, 6)])
        assert r.claims_refused == 1 and r.exported == 2 and r.skipped_no_slot == 1
        assert st.lookup(0, 1) is not None  # still stored: its slot was not reused
        # the leased slot still holds key 1's bytes
        slot = held.locations[0].slot
        assert_block_equal([t[slot] for t in st.caches(Tier.GPU)[0]], block_of(a_cache, 0, 1))
        d.release(held.lease_ids)
        r2 = await st.export(views, [(0, 7, 7)])
        assert r2.exported == 1 and st.lookup(0, 1) is None  # now it could go
        return st

    asyncio.run(run()).close()
    assert d.outstanding_leases == 0


def test_cpu_tier_takes_overflow_from_a_tiny_gpu_tier():
    a_cache, b_cache, layout, views = world(2)
    d = BlockDirectory()

    async def run():
        st = storage(layout, LocalDirectory(d), gpu_blocks=2, cpu_blocks=8)
        for step in range(3):
            await st.export(views, [(0, 10 + 2 * step + j, 1 + 2 * step + j) for j in range(2)])
        assert st.used(Tier.GPU) == 2 and st.used(Tier.CPU) == 4
        res = await load_on_b(d, st, b_cache, list(range(10, 16)), list(range(20, 26)))
        tiers = [loc.tier for loc in res.locations]
        assert res.num_hits == 6 and tiers.count(Tier.CPU) == 4 and tiers.count(Tier.GPU) == 2
        return st

    asyncio.run(run()).close()
    for i in range(6):
        assert_block_equal(block_of(b_cache, 0, 20 + i), block_of(a_cache, 0, 1 + i))
    assert d.outstanding_leases == 0


def test_a_step_larger_than_the_gpu_tier_spills_to_the_cpu_tier():
    a_cache, b_cache, layout, views = world(4)
    d = BlockDirectory()

    async def run():
        st = storage(layout, LocalDirectory(d), gpu_blocks=2, cpu_blocks=8)
        r = await st.export(views, [(0, 30 + i, 1 + i) for i in range(5)])
        assert (r.exported, r.skipped_no_slot) == (5, 0)
        assert st.used(Tier.GPU) == 2 and st.used(Tier.CPU) == 3
        assert [st.lookup(0, 30 + i)[0] for i in range(5)] == [Tier.GPU] * 2 + [Tier.CPU] * 3
        await load_on_b(d, st, b_cache, [30 + i for i in range(5)], [10 + i for i in range(5)])
        return st

    asyncio.run(run()).close()
    for i in range(5):
        assert_block_equal(block_of(b_cache, 0, 10 + i), block_of(a_cache, 0, 1 + i))
    assert d.outstanding_leases == 0


def test_shared_memory_tier_maps_elsewhere_and_files_go_on_close():
    _, _, layout, views = world(3)

    async def run():
        st = storage(layout, LocalDirectory(), gpu_blocks=1, cpu_blocks=4, shared=True)
        await st.export(views, [(0, 1, 1), (0, 2, 2)])  # the second demotes the first
        handles = st.shm_handles(Tier.CPU)
        mapped = open_shm(handles)
        slot = st.lookup(0, 1)[1]
        assert_block_equal([t[slot] for t in mapped[0]], [t[slot] for t in st.caches(Tier.CPU)[0]])
        return st, handles

    st, handles = asyncio.run(run())
    paths = [p for layers in handles.values() for p, _, _ in layers]
    assert all(os.path.exists(p) for p in paths)
    st.close()
    assert not any(os.path.exists(p) for p in paths)


def test_export_reports_where_its_time_went():
    """``copy_us`` / ``directory_us`` (``export_copy_us`` ... in the counters) grow with the
    work: an export that demotes copies and registers twice."""
    _, _, layout, views = world(5)

    async def run():
        st = storage(layout, LocalDirectory(), gpu_blocks=2, cpu_blocks=8)
        first = await st.export(views, [(0, 1, 1), (0, 2, 2)])
        again = await st.export(views, [(0, 1, 1), (0, 2, 2)])  # already stored: no work
        demoting = await st.export(views, [(0, 3, 3), (0, 4, 4)])
        st.close()
        return first, again, demoting

    first, again, demoting = asyncio.run(run())
    assert first.copy_us > 0 and first.directory_us > 0 and first.demoted == 0
    assert (again.already_stored, again.copy_us, again.directory_us) == (2, 0, 0)
    assert demoting.demoted == 2 and demoting.copy_us > 0 and demoting.directory_us > 0


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared_memory"])
def test_pinned_cpu_tier_is_page_locked_until_close(shared):
    """With CUDA the CPU tier is registered (``is_pinned``) and unregistered on close;
    without CUDA ``pin`` changes nothing (CI): the storage works the same."""
    a_cache, b_cache, layout, views = world(6)
    d = BlockDirectory()

    async def run():
        st = storage(layout, LocalDirectory(d), gpu_blocks=1, cpu_blocks=4, shared=shared,
                     pin=True)
        cpu_layers = st.caches(Tier.CPU)[0]
        assert all(t.is_pinned() for t in cpu_layers) == torch.cuda.is_available()
        await st.export(views, [(0, 1, 1), (0, 2, 2)])  # the second demotes the first
        await load_on_b(d, st, b_cache, [1, 2], [20, 21])
        pinned = list(st._tiers[Tier.CPU].pinned)
        st.close()
        return pinned

    pinned = asyncio.run(run())
    assert len(pinned) == (len(layout.group(0).layers) + len(layout.group(1).layers)
                           if torch.cuda.is_available() else 0)
    for i in range(2):
        assert_block_equal(block_of(b_cache, 0, 20 + i), block_of(a_cache, 0, 1 + i))
    assert d.outstanding_leases == 0


def test_make_room_demotes_ahead_so_the_next_export_only_copies():
    a_cache, b_cache, layout, views = world(7)
    d = BlockDirectory()

    async def run():
        st = storage(layout, LocalDirectory(d), gpu_blocks=4, cpu_blocks=8)
        await st.export(views, [(0, 1 + i, 1 + i) for i in range(4)])  # GPU tier full
        held = d.query(0, [1], exclude_rank=2)  # a peer holds the LRU block 1
        room = await st.make_room(2)
        # both victims were demoted first; the leased one keeps its GPU slot (asked again
        # for the one slot still missing, it is refused again and make_room stops)
        assert (room.demoted, room.evicted, room.claims_refused) == (2, 1, 2)
        assert st.used(Tier.GPU) == 3 and st.used(Tier.CPU) == 2
        d.release(held.lease_ids)
        room = await st.make_room(2)  # block 1 is in the CPU tier already: no copy
        assert (room.demoted, room.evicted) == (0, 1) and st.used(Tier.GPU) == 2
        nxt = await st.export(views, [(0, 5, 5), (0, 6, 6)])
        assert (nxt.exported, nxt.demoted, nxt.evicted) == (2, 0, 0)  # only its copies
        room = await st.make_room(100)  # capped by the tier: all of it, in chunks
        assert (room.demoted, room.evicted) == (4, 4) and st.used(Tier.GPU) == 0
        await load_on_b(d, st, b_cache, [1, 2, 3, 4, 5, 6], list(range(20, 26)))
        st.close()
        assert (await st.make_room(2)).evicted == 0  # closed: nothing

    asyncio.run(run())
    for i in range(6):  # every block still loads from the CPU tier, bit-exact
        assert_block_equal(block_of(b_cache, 0, 20 + i), block_of(a_cache, 0, 1 + i))
    assert d.outstanding_leases == 0


def test_make_room_lets_an_export_in_between_its_chunks(monkeypatch):
    """An export that arrives while make_room works waits for one chunk, not all of it."""
    from xinference.model.llm.vllm.xavier import snapshot_storage

    monkeypatch.setattr(snapshot_storage, "ROOM_CHUNK_BLOCKS", 2)
    _, _, layout, views = world(8)
    order = []

    async def run():
        st = storage(layout, LocalDirectory(), gpu_blocks=8, cpu_blocks=16)
        await st.export(views, [(0, 1 + i, 1 + i) for i in range(8)])
        evict = st._evict

        async def traced(*args):
            order.append("chunk")
            return await evict(*args)

        st._evict = traced
        room = asyncio.ensure_future(st.make_room(8))
        await asyncio.sleep(0)  # make_room holds the lock for its first chunk
        res = await st.export(views, [(0, 20, 20)])
        order.append("export")
        await room
        st.close()
        return res

    res = asyncio.run(run())
    assert res.exported == 1
    assert order.index("export") <= 2 and order.count("chunk") >= 3, order


def test_budget_smaller_than_a_block_is_named():
    _, _, layout, _ = world()
    with pytest.raises(ValueError, match="^budget: GPU tier budget 10 bytes holds no block"):
        SnapshotStorage(1, layout, [TierConfig(Tier.GPU, 10)], LocalDirectory())


def test_slot_allocator_lru_and_generations():
    a = SlotAllocator(2)
    s0, s1 = a.take_free(), a.take_free()
    assert a.take_free() is None
    assert a.assign(10, s0) == 1 and a.assign(11, s1) == 1
    a.lookup(10)  # touch: 11 is now least recently used
    assert a.victims(1) == [s1]
    assert a.release(s1) == 11 and a.assign(12, s1) == 2
    with pytest.raises(ValueError, match="^slot: "):
        a.assign(13, s0)
    assert a.release(s1) == 12
    with pytest.raises(ValueError, match="^key: 10 is already stored"):
        a.assign(10, s1)
