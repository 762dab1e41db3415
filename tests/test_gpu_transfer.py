"""The batched load engine on real tensors (CPU here; the same tests run on CUDA
when a device is present: XAVIER_TEST_DEVICE=cuda)."""

import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xinference.model.llm.vllm.xavier.mechanism import block_copy, gpu_transfer
from xinference.model.llm.vllm.xavier.mechanism.gpu_transfer import GPUTransfer
from xinference.model.llm.vllm.xavier.mechanism.kv_schema import SchemaMismatchError, layout_of
from xinference.model.llm.vllm.xavier.mechanism.load_handle import (
    CloseError,
    FetchedRows,
    LoadError,
    LoadRejected,
    TransferClosedError,
)
from xinference.model.llm.vllm.xavier.planning.load_batch import NULL_BLOCK_ID, Tier
from xinference.model.llm.vllm.xavier.planning.plan import ConflictingWriteError, SlabConfig

from .kvfixtures import (
    BLOCK_DIM,
    bits,
    block,
    expected_after,
    loads,
    make_caches,
    make_world,
    random_bits,
)
from .support.reliability import record

DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
N_BLOCKS, N_SLOTS = 64, 48
CFG = SlabConfig(full_rows=8, small_rows=2, switch_after=2)


def assert_equal_bits(got, exp):
    for g in exp:
        for a, b in zip(got[g], exp[g]):
            assert torch.equal(bits(a.cpu()), bits(b.cpu())), f"group {g} differs"


def engine_with(world, local, cfg=CFG, kernel=None):
    eng = GPUTransfer(rank=0, slab_config=cfg, copy_kernel=kernel)
    eng.set_local_caches(local, BLOCK_DIM)
    for (rank, tier), caches in world.storages.items():
        eng.map_storage(rank, Tier(tier), caches, BLOCK_DIM)
    return eng


@st.composite
def scenarios(draw):
    keys = draw(st.lists(st.integers(1, 2**40), min_size=1, max_size=10, unique=True))
    holders = {}
    for rank in (1, 2, 3):
        for tier in (0, 1):
            if draw(st.booleans()):
                holders[(rank, tier)] = draw(st.lists(st.sampled_from(keys), unique=True,
                                                      max_size=len(keys)))
    offers = [(k, rt) for rt, held in holders.items() for k in held]
    dest_key = {}
    requests = []
    for _ in range(draw(st.integers(0, 5))):
        req = []
        for _ in range(draw(st.integers(0, 24))):
            if not offers:
                break
            k, (rank, tier) = draw(st.sampled_from(offers))
            g = draw(st.integers(0, 1))
            if draw(st.integers(0, 9)) == 0:
                d = NULL_BLOCK_ID
            else:
                free = [d for d in range(1, N_BLOCKS) if dest_key.get((g, d), k) == k]
                d = draw(st.sampled_from(free))
                dest_key[(g, d)] = k
            req.append((g, k, rank, tier, None, d))
        requests.append(req)
    return keys, holders, requests, dest_key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**31))
def test_batched_load_bit_exact_and_counters_exact(dtype, scenario, seed):
    keys, holders, requests, dest_key = scenario
    gen = torch.Generator().manual_seed(seed)
    world = make_world(keys, holders, N_SLOTS, dtype, gen, DEVICE)
    rows = [[(g, k, r, t, world.slot_of[(r, t, g, k)], d) for g, k, r, t, _, d in req]
            for req in requests]
    local = make_caches(N_BLOCKS, dtype, gen, DEVICE)
    expected = expected_after(local, world, dest_key)

    eng = engine_with(world, local)
    res = eng.load_gpu_requests_v1(loads(rows)).wait(30)
    eng.close()
    assert_equal_bits(local, expected)
    reads = {(g, k) for (g, d), k in dest_key.items()}
    block_bytes = {g: sum(t[0].numel() for t in [[x.select(BLOCK_DIM[g], 0)]
                                                  for x in local[g]]) * local[g][0].element_size()
                   for g in local}
    c = eng.counters
    assert res.blocks_written == c.blocks_written == len(dest_key)
    assert c.useful_bytes == sum(block_bytes[g] for g, _ in reads)
    assert c.padded_bytes == res.padded_bytes
    assert c.batch_calls == 1 and c.logical_requests == len(requests)
    assert c.transfers == res.transfers


def test_negative_control_skipped_copy_is_caught(monkeypatch):
    """The same check catches a load that claims success but skips the copy."""
    gen = torch.Generator().manual_seed(1)
    world = make_world([5, 6], {(1, 0): [5, 6]}, N_SLOTS, torch.bfloat16, gen, DEVICE)
    local = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)
    dest_key = {(0, 3): 5, (1, 4): 6}
    rows = [[(g, k, 1, 0, world.slot_of[(1, 0, g, k)], d) for (g, d), k in dest_key.items()]]
    expected = expected_after(local, world, dest_key)
    monkeypatch.setattr(gpu_transfer, "copy_transfer", lambda *a, **k: None)

    eng = engine_with(world, local, kernel="torch")
    res = eng.load_gpu_requests_v1(loads(rows)).wait(30)
    assert res.blocks_written == 2  # claimed ...
    with pytest.raises(AssertionError, match="differs"):
        assert_equal_bits(local, expected)  # ... but caught


def _simple(dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    world = make_world([5, 6, 7], {(1, 0): [5, 6, 7], (2, 1): [5, 6, 7]}, N_SLOTS, dtype, gen,
                       DEVICE)
    local = make_caches(N_BLOCKS, dtype, gen, DEVICE)
    return world, local


def test_conflict_rejected_before_any_byte_is_written():
    world, local = _simple()
    before = {g: [t.clone() for t in ts] for g, ts in local.items()}
    s = world.slot_of
    rows = [[(0, 5, 1, 0, s[(1, 0, 0, 5)], 3), (0, 6, 1, 0, s[(1, 0, 0, 6)], 9)],
            [(0, 7, 2, 1, s[(2, 1, 0, 7)], 9)]]

    eng = engine_with(world, local)
    with pytest.raises(ConflictingWriteError, match="destination block 9"):
        eng.load_gpu_requests_v1(loads(rows))
    assert_equal_bits(local, before)
    assert eng.counters.rejected_batches == 1 and eng.counters.batch_calls == 0


@pytest.mark.parametrize("row, field", [
    ((0, 5, 1, 0, 10_000, 3), "slot"),
    ((0, 5, 1, 0, 0, 10_000), "dest"),
    ((0, 5, 9, 0, 0, 3), "rank"),
])
def test_out_of_range_or_unmapped_rejected_and_named(row, field):
    world, local = _simple()
    before = {g: [t.clone() for t in ts] for g, ts in local.items()}
    good = (0, 6, 1, 0, world.slot_of[(1, 0, 0, 6)], 4)

    eng = engine_with(world, local)
    with pytest.raises(LoadRejected, match=f"^{field}: "):
        eng.load_gpu_requests_v1(loads([[good, row]]))
    assert_equal_bits(local, before)


def _remote(world, rank, tier, gate=None, fail=False):
    """A fetch that serves ``world``'s storage of ``(rank, tier)`` as another host would
    (staging rows), on the completion thread; it waits for ``gate`` and can fail."""
    caches = world.storages[(rank, tier)]

    def fetch(t):
        if gate is not None:
            assert gate.wait(30)
        if fail:
            raise ConnectionError("source host unreachable")
        idx = torch.as_tensor(t.src_slots)
        return FetchedRows([block_copy.as_byte_rows(block_copy.block_view(x, BLOCK_DIM[t.group])
                                                    .index_select(0, idx.to(x.device)).cpu())
                            for x in caches[t.group]])

    return fetch


def test_background_load_is_reportable_only_after_its_copy_and_close_waits():
    """A load whose source is another host's: launched, not yet done, not reportable (so
    vLLM is not told it finished, and the scheduler half keeps its leases); it completes on
    the completion thread, then is; close() waits for it."""
    world, local = _simple()
    s = world.slot_of
    dest_key = {(0, 3): 5, (0, 4): 6, (1, 5): 7}
    rows = [[(g, k, 1, 0, s[(1, 0, g, k)], d) for (g, d), k in dest_key.items()]]
    expected = expected_after(local, world, dest_key)
    gate = threading.Event()
    eng = GPUTransfer(rank=0, slab_config=CFG)
    eng.set_local_caches(local, BLOCK_DIM)
    layout = layout_of(world.storages[(1, 0)], BLOCK_DIM)
    eng.map_remote_storage(1, Tier.GPU, layout, _remote(world, 1, 0, gate))
    handle = eng.load_gpu_requests_v1(loads(rows))
    time.sleep(0.2)
    assert not handle.reportable and not handle.done  # the copy has not happened
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close() waits for the load in flight
    gate.set()
    closer.join(30)
    assert not closer.is_alive() and eng.closed
    res = handle.wait(0)
    assert res.failed == frozenset() and res.blocks_written == 3 and handle.reportable
    assert_equal_bits(local, expected)
    assert eng.counters.batch_calls == 1


def test_a_load_the_completion_thread_runs_is_not_quick():
    """A load of mapped memory is *quick* (the plane may wait for it when vLLM first asks),
    ordered after the caller's stream or after named events only (``ordered_after``, the
    worker's asynchronous loads); one the completion thread runs (another host's) is not;
    the bytes are the same either way."""
    world, local = _simple()
    s = world.slot_of
    dest_key = {(0, 3): 5, (0, 4): 6, (1, 5): 7}
    rows = [[(g, k, 1, 0, s[(1, 0, g, k)], d) for (g, d), k in dest_key.items()]]
    expected = expected_after(local, world, dest_key)
    eng = engine_with(world, local)
    quick = eng.load_gpu_requests_v1(loads(rows), ordered_after=[])
    plain = eng.load_gpu_requests_v1(loads(rows))
    assert quick.quick and plain.quick
    assert quick.wait(30).blocks_written == plain.wait(30).blocks_written == 3
    assert_equal_bits(local, expected)
    eng.close()

    gate = threading.Event()
    gate.set()
    eng = GPUTransfer(rank=0, slab_config=CFG)
    eng.set_local_caches(local, BLOCK_DIM)
    eng.map_remote_storage(1, Tier.GPU, layout_of(world.storages[(1, 0)], BLOCK_DIM),
                           _remote(world, 1, 0, gate))
    remote = eng.load_gpu_requests_v1(loads(rows), ordered_after=[])
    assert not remote.quick and remote.wait(30).blocks_written == 3
    eng.close()


def test_a_failed_remote_transfer_fails_only_its_blocks():
    world, local = _simple()
    s = world.slot_of
    rows = [[(0, 5, 1, 0, s[(1, 0, 0, 5)], 3), (0, 6, 2, 1, s[(2, 1, 0, 6)], 4)]]
    expected = expected_after(local, world, {(0, 3): 5})
    eng = GPUTransfer(rank=0, slab_config=CFG)
    eng.set_local_caches(local, BLOCK_DIM)
    eng.map_storage(1, Tier.GPU, world.storages[(1, 0)], BLOCK_DIM)
    layout = layout_of(world.storages[(2, 1)], BLOCK_DIM)
    eng.map_remote_storage(2, Tier.CPU, layout, _remote(world, 2, 1, fail=True))
    res = eng.load_gpu_requests_v1(loads(rows)).wait(30)
    assert res.failed == frozenset({4}) and res.blocks_written == 1
    got = {g: [t.clone() for t in ts] for g, ts in local.items()}
    for g in got:  # block 4 is whatever it was; compare the rest
        for a, b in zip(got[g], expected[g]):
            a.select(BLOCK_DIM[g], 4).copy_(b.select(BLOCK_DIM[g], 4))
    assert_equal_bits(got, expected)
    assert eng.counters.load_failures == 1 and eng.counters.blocks_written == 1
    eng.close()


def test_copy_failure_reports_planned_blocks_at_once(monkeypatch):
    world, local = _simple()
    s = world.slot_of
    rows = [[(0, 5, 1, 0, s[(1, 0, 0, 5)], 3), (0, 6, 2, 1, s[(2, 1, 0, 6)], 4)]]
    calls = []
    real_copy = gpu_transfer.copy_transfer

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("peer mapping vanished")
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(gpu_transfer, "copy_transfer", failing_second)

    eng = engine_with(world, local, kernel="torch")
    handle = eng.load_gpu_requests_v1(loads(rows))
    # reportable at once (nothing runs in the background): already known failed, before the
    # completion thread has run, so nobody can report these blocks as loaded
    assert handle.reportable and handle.failed == {3, 4}
    with pytest.raises(LoadError) as ei:
        handle.wait(30)
    err = ei.value
    assert err.planned[0].tolist() == [3, 4]
    assert handle.failed == {3, 4}  # every planned destination is suspect
    assert eng.counters.load_failures == 1 and eng.counters.batch_calls == 0


def test_close_twice_then_load_and_map_refused():
    world, local = _simple()

    eng = engine_with(world, local)
    eng.close()
    eng.close()
    assert eng.closed and eng.mapped() == []
    with pytest.raises(TransferClosedError, match="load_gpu_requests_v1: .* closed"):
        eng.load_gpu_requests_v1(loads([[]]))
    with pytest.raises(TransferClosedError, match="map_storage: .* closed"):
        eng.map_storage(1, Tier.GPU, world.storages[(1, 0)], BLOCK_DIM)


def test_close_that_fails_halfway_can_be_retried():
    world, local = _simple()
    released = []
    fail_once = {"left": 1}

    def release_of(name):
        def release():
            if name == "r1" and fail_once["left"]:
                fail_once["left"] -= 1
                raise OSError("unmap failed")
            released.append(name)
        return release

    eng = GPUTransfer(rank=0, slab_config=CFG)
    eng.set_local_caches(local, BLOCK_DIM, release=release_of("local"))
    eng.map_storage(1, Tier.GPU, world.storages[(1, 0)], BLOCK_DIM, release_of("r1"))
    eng.map_storage(2, Tier.CPU, world.storages[(2, 1)], BLOCK_DIM, release_of("r2"))
    with pytest.raises(CloseError, match="rank 1 GPU storage"):
        eng.close()
    assert sorted(released) == ["local", "r2"] and not eng.closed
    with pytest.raises(TransferClosedError):
        eng.load_gpu_requests_v1(loads([[]]))
    eng.close()
    assert eng.closed
    eng.close()
    assert sorted(released) == ["local", "r1", "r2"]
    record("one unmapping fails in close() (load engine)", 1, 1, 0, 0,
           "rest released, CloseError, retried close() completes")


def test_replacing_the_local_caches_lets_go_of_the_previous_ones_once():
    """A second set_local_caches calls the first caches' release (as remapping a storage
    does), exactly once, and loads go to the new caches; close releases only the new."""
    world, local = _simple()
    released = []
    eng = GPUTransfer(rank=0, slab_config=CFG)
    eng.set_local_caches(local, BLOCK_DIM, release=lambda: released.append("first"))
    gen = torch.Generator().manual_seed(9)
    second = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)
    eng.set_local_caches(second, BLOCK_DIM, release=lambda: released.append("second"))
    assert released == ["first"]
    eng.map_storage(1, Tier.GPU, world.storages[(1, 0)], BLOCK_DIM)
    before = [bits(t).clone() for t in local[0]]
    slot = world.slot_of[(1, 0, 0, 5)]
    eng.load_gpu_requests_v1(loads([[(0, 5, 1, 0, slot, 3)]])).wait(30)
    for src, dst in zip(world.storages[(1, 0)][0], second[0]):
        assert torch.equal(bits(block(dst, BLOCK_DIM[0], 3)), bits(block(src, BLOCK_DIM[0], slot)))
    assert all(torch.equal(bits(t), b) for t, b in zip(local[0], before))  # the old: untouched
    eng.close()
    assert released == ["first", "second"]


@pytest.mark.parametrize("change", ["dtype", "shape", "group"])
def test_schema_mismatch_refused_nothing_mapped(change):
    gen = torch.Generator().manual_seed(3)
    local = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)
    if change == "dtype":
        peer = make_caches(N_SLOTS, torch.float16, gen, DEVICE)
        pattern = "dtype torch.float16 does not match local torch.bfloat16"
    elif change == "shape":
        peer = make_caches(N_SLOTS, torch.bfloat16, gen, DEVICE)
        peer[0][1] = peer[0][1][..., :1].clone()
        pattern = "block_shape"
    else:
        peer = make_caches(N_SLOTS, torch.bfloat16, gen, DEVICE, groups=(0,))
        pattern = "group 1 missing"

    eng = GPUTransfer(rank=0, slab_config=CFG)
    eng.set_local_caches(local, BLOCK_DIM)
    with pytest.raises(SchemaMismatchError, match=pattern):
        eng.map_storage(1, Tier.GPU, peer, BLOCK_DIM)
    assert eng.mapped() == []


def test_slabs_are_bounded_and_full_slab_released_on_close():
    world, local = _simple()
    s = world.slot_of
    rows = [[(0, k, 1, 0, s[(1, 0, 0, k)], 10 + i) for i, k in enumerate((5, 6, 7))]]

    eng = engine_with(world, local, kernel="torch")  # the slab-staged path
    eng.load_gpu_requests_v1(loads(rows)).wait(30)
    slabs = eng._slabs
    per_block = sum(t.numel() * t.element_size() for t in local[0]) // N_BLOCKS
    assert slabs.allocated_bytes == CFG.full_rows * per_block  # one full slab, group 0
    eng.load_gpu_requests_v1(loads(rows)).wait(30)
    assert slabs.allocated_bytes == CFG.full_rows * per_block  # reused, not grown
    eng.close()
    assert slabs.allocated_bytes == 0


@pytest.mark.parametrize("shape, dim, word", [((5, 2, 4), 0, torch.int64), ((5, 3), 0, torch.int16),
                                              ((2, 5, 4), 1, torch.int16)])
def test_block_view_is_an_integer_view_that_writes_through(shape, dim, word):
    t = torch.zeros(shape, dtype=torch.bfloat16)
    v = block_copy.block_view(t, dim)
    assert v.dtype == word and v.shape[0] == 5
    v[4] = -1  # all bits set: a bf16 NaN pattern
    assert bits(t.select(dim, 4)).eq(-1).all()
    assert int(bits(t).ne(0).sum()) == t.select(dim, 4).numel()


def _permuted_cache(n_blocks, gen):
    """vLLM's TRITON_ATTN cache on CUDA: logical ``[blocks, heads, tokens, 2*head]``, stored
    ``[blocks, tokens, heads, 2*head]`` (its NHD stride order), as a permuted view."""
    return random_bits((n_blocks, 16, 2, 8), torch.bfloat16, gen).permute(0, 2, 1, 3)


def test_permuted_engine_caches_round_trip_through_a_storage_bit_exact():
    """Blocks of a permuted engine cache are one dense range each: the block view is one row
    of their bytes in memory order, the layout's block shape is that order, a storage
    allocated from the layout holds the bytes as they lie, and a load into another permuted
    engine gives back every logical element.  A contiguous engine of the same logical shape
    is refused naming the block shape (its bytes lie differently)."""
    gen = torch.Generator().manual_seed(7)
    source, dest = _permuted_cache(12, gen), _permuted_cache(20, gen)
    assert not source.is_contiguous()
    layout = layout_of({0: [source]})
    assert layout.groups[0].layers[0].block_shape == (16, 2, 8)  # memory order
    view = block_copy.block_view(source, 0)
    assert view.dim() == 2 and view.dtype == torch.int64 and view.shape == (12, 16 * 2 * 8 // 4)
    storage = torch.zeros((6, *layout.groups[0].layers[0].block_shape), dtype=torch.bfloat16)
    block_copy.copy_rows([view], [block_copy.block_view(storage, 0)], [3, 7, 11], [0, 1, 2])

    eng = GPUTransfer(0, SlabConfig(4, 2, 2))
    eng.set_local_caches({0: [dest]})
    eng.map_storage(1, Tier.GPU, {0: [storage]})
    before = dest.clone()
    eng.load_gpu_requests_v1(loads([[(0, 70 + i, 1, 0, i, 5 + i) for i in range(3)]])).wait(30)
    for src_block, dst_block in zip((3, 7, 11), (5, 6, 7)):
        assert torch.equal(bits(dest[dst_block]), bits(source[src_block]))  # logical equality
    untouched = [b for b in range(20) if b not in (5, 6, 7)]
    assert torch.equal(bits(dest[untouched]), bits(before[untouched]))
    eng.close()

    contiguous = torch.zeros((20, 2, 16, 8), dtype=torch.bfloat16)
    eng = GPUTransfer(0, SlabConfig(4, 2, 2))
    eng.set_local_caches({0: [contiguous]})
    with pytest.raises(SchemaMismatchError, match="block_shape"):
        eng.map_storage(1, Tier.GPU, {0: [storage]})
    eng.close()


def test_blocks_that_are_not_one_dense_range_keep_the_logical_view():
    """K and V halves apart (``[2, blocks, ...]`` moved block-first): no row view, the
    layout keeps the logical block shape."""
    t = torch.zeros((2, 10, 16, 8), dtype=torch.bfloat16)
    assert block_copy.block_memory_order(t.movedim(1, 0)) is None
    assert block_copy.block_view(t, 1).dim() == 4
    assert layout_of({0: [t]}, 1).groups[0].layers[0].block_shape == (2, 16, 8)
