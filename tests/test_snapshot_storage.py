"""Snapshot storage memory (the transfer actor's): tiers, handles, shared memory, pinning.

The worker's bookkeeping and exports are in test_storage_writer.py; the same flow across
real processes in test_storage_multiprocess.py.
"""

import os
import secrets

import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (
    SnapshotStorage,
    TierConfig,
    open_tier,
    remove_orphaned_shm_files,
)
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier
from xinference.model.llm.vllm.xavier.planning.shm_words import shm_dir
from xinference.model.llm.vllm.xavier.planning.slot_allocator import SlotAllocator

from .kvfixtures import BLOCK_DIM, make_caches


def layout():
    gen = torch.Generator().manual_seed(0)
    return layout_of(make_caches(8, torch.bfloat16, gen), BLOCK_DIM)


def test_tiers_hold_whole_blocks_of_every_group_under_the_budget():
    lay = layout()
    per_block = max(g.block_bytes for g in lay.groups) * len(lay.groups)
    st = SnapshotStorage(1, lay, [TierConfig(Tier.GPU, 5 * per_block + 7),
                                  TierConfig(Tier.CPU, 3 * per_block, shared_memory=True)])
    assert st.tiers == [Tier.GPU, Tier.CPU]
    assert st.slots(Tier.GPU) == 5 and st.slots(Tier.CPU) == 3
    for tier in st.tiers:
        for g in lay.groups:
            layers = st.caches(tier)[g.group]
            assert [tuple(t.shape[1:]) for t in layers] == [la.block_shape for la in g.layers]
            assert all(t.shape[0] == st.slots(tier) for t in layers)
    st.close()
    st.close()  # idempotent
    with pytest.raises(RuntimeError, match="gather_rows: the snapshot storage of rank 1 is "
                                           "closed"):
        st.gather_rows(Tier.GPU, 0, [0])
    with pytest.raises(RuntimeError, match="shm_handles: .* closed"):
        st.shm_handles(Tier.CPU)  # a closed storage hands out nothing to map
    for what, call in (("caches", lambda: st.caches(Tier.GPU)),
                       ("views", lambda: st.views(Tier.CPU, 0)),
                       ("handles", st.handles)):
        with pytest.raises(RuntimeError, match=f"^{what}: the snapshot storage of rank 1 is "
                                               "closed"):
            call()  # not an empty mapping that fails later as a schema mismatch


def test_shared_memory_tier_maps_elsewhere_and_files_go_on_close():
    lay = layout()
    per_block = max(g.block_bytes for g in lay.groups) * len(lay.groups)
    st = SnapshotStorage(1, lay, [TierConfig(Tier.CPU, 4 * per_block, shared_memory=True)])
    handles = st.handles()
    kind, h = handles[int(Tier.CPU)]
    assert kind == "shm"
    mapped, release = open_tier(kind, h)
    st.caches(Tier.CPU)[0][0][2].fill_(7)  # written by the owner ...
    assert bool((mapped[0][0][2] == 7).all())  # ... seen through the mapping
    rows = st.gather_rows(Tier.CPU, 0, [2])
    assert rows[0].dtype == torch.uint8 and rows[0].shape[0] == 1
    paths = [p for layers in h.values() for p, _, _ in layers]
    assert all(os.path.exists(p) for p in paths)
    # a killed process's file (its pid gone, no owner lock) appears while the storage lives:
    # its close sweeps it, as the next storage's start would (none may start again)
    orphan = os.path.join(shm_dir(), f"xavier-{2**22 + 12345}-{secrets.token_hex(16)}")
    with open(orphan, "wb") as f:
        f.write(b"x")
    release()
    st.close()
    assert not any(os.path.exists(p) for p in paths)
    assert not os.path.exists(orphan)


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared_memory"])
def test_pinned_cpu_tier_is_page_locked_until_close(shared):
    """With CUDA the CPU tier is registered (``is_pinned``) and unregistered on close;
    without CUDA ``pin`` changes nothing (CI): the storage works the same."""
    lay = layout()
    per_block = max(g.block_bytes for g in lay.groups) * len(lay.groups)
    st = SnapshotStorage(1, lay, [TierConfig(Tier.CPU, 4 * per_block, shared_memory=shared,
                                             pin=True)])
    layers = st.caches(Tier.CPU)[0]
    assert all(t.is_pinned() for t in layers) == torch.cuda.is_available()
    pinned = list(st._tiers[Tier.CPU].pinned)
    st.close()
    assert len(pinned) == (sum(len(g.layers) for g in lay.groups)
                           if torch.cuda.is_available() else 0)


def test_budget_smaller_than_a_block_is_named():
    with pytest.raises(ValueError, match="^budget: GPU tier budget 10 bytes holds no block"):
        SnapshotStorage(1, layout(), [TierConfig(Tier.GPU, 10)])


def test_orphaned_shared_memory_files_of_dead_processes_are_swept(tmp_path):
    dead, alive = 2**22 + 12345, os.getpid()
    (tmp_path / f"xavier-{dead}-{'a' * 32}").write_bytes(b"x")
    (tmp_path / f"xavier-{alive}-{'b' * 32}").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    removed = remove_orphaned_shm_files(str(tmp_path))
    assert [os.path.basename(p) for p in removed] == [f"xavier-{dead}-{'a' * 32}"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"xavier-{alive}-{'b' * 32}", "other"])


def test_slot_allocator_lru_and_generations():
    a = SlotAllocator(2)
    s0, s1 = a.take_free(), a.take_free()
    assert a.take_free() is None
    assert a.assign(10, s0) == 1 and a.assign(11, s1) == 1
    a.lookup(10)  # touch: 11 is now least recently used
    assert a.victims(1) == [s1]
    assert a.victims(1, exclude={11}) == [s0]  # pending keys are passed over
    assert a.release(s1) == 11 and a.assign(12, s1) == 2
    with pytest.raises(ValueError, match="^slot: "):
        a.assign(13, s0)
    assert a.release(s1) == 12
    with pytest.raises(ValueError, match="^key: 10 is already stored"):
        a.assign(10, s1)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_typed_caches_are_stored_and_mapped_bit_exact(dtype):
    """vLLM types an fp8 KV cache as float8 tensors: the storage allocates tiers of that
    dtype (one dtype table for the package) and a mapping elsewhere sees the same bytes."""
    gen = torch.Generator().manual_seed(3)
    caches = make_caches(8, dtype, gen)
    lay = layout_of(caches, BLOCK_DIM)
    per_block = max(g.block_bytes for g in lay.groups) * len(lay.groups)
    st = SnapshotStorage(1, lay, [TierConfig(Tier.CPU, 4 * per_block, shared_memory=True)])
    kind, h = st.handles()[int(Tier.CPU)]
    mapped, release = open_tier(kind, h)
    for g in lay.groups:
        for own, seen in zip(st.caches(Tier.CPU)[g.group], mapped[g.group]):
            assert own.dtype == dtype and seen.dtype == dtype
            own.view(torch.uint8).copy_(torch.randint(0, 256, own.view(torch.uint8).shape,
                                                      dtype=torch.uint8, generator=gen))
            assert torch.equal(own.view(torch.uint8), seen.view(torch.uint8))
    release()
    st.close()


def test_no_cuda_views_of_host_tiers_on_a_cpu_engine():
    """The CPU engine keeps reading and writing host tiers directly (no CUDA views)."""
    from xinference.model.llm.vllm.xavier.mechanism.uva import cuda_views

    assert cuda_views({0: [torch.zeros(4, 8)]}, torch.device("cpu")) is None
    assert cuda_views({0: [torch.zeros(4, 8)]}, None) is None
