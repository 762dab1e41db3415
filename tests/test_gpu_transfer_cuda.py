"""CUDA-only: the fused Triton kernel, stream ordering without host waits, storages mapped
through CUDA IPC, the worker's exports and demotions on the GPU.

Skipped without a CUDA device (CI); run on the lent GPU (see doc/gpu.md).  The
rest of the engine's tests run on CUDA too with XAVIER_TEST_DEVICE=cuda.
"""

import time

import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism.gpu_transfer import GPUTransfer
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier
from xinference.model.llm.vllm.xavier.planning.plan import SlabConfig

from .kvfixtures import bits, loads, random_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

LAYERS, BLOCK = 6, (2, 16, 128)  # TRITON_ATTN-like block: [2, block_size, kv_heads*head]


def storage(n, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    return [random_bits((n, *BLOCK), torch.bfloat16, gen, device) for _ in range(LAYERS)]


SLAB = SlabConfig(32, 8, 2)


def load_from_peer(local, peer, rows, slab=SLAB, kernel=None):
    """Map ``peer`` as rank 1's GPU tier, load ``rows`` into ``local``, close; counters."""

    eng = GPUTransfer(0, slab, copy_kernel=kernel)
    eng.set_local_caches({0: local})
    eng.map_storage(1, Tier.GPU, peer)
    eng.load_gpu_requests_v1(loads(rows)).wait(60)
    eng.close()
    torch.cuda.synchronize()
    return eng.counters


def produce(queue, done, n, seed):
    """Child process: owns a CUDA storage, shares it through CUDA IPC, waits."""
    layers = storage(n, seed)
    queue.put(layers)
    done.wait(120)


@pytest.mark.parametrize("kernel, fused", [("auto", True), ("triton", True), ("torch", False)])
def test_fused_kernel_bit_exact(kernel, fused):
    local, peer = storage(300, 1), storage(200, 2)
    rows = [[(0, 1000 + i, 1, 0, (7 * i) % 200, 1 + i) for i in range(150)],
            [(0, 1000, 1, 0, 0, 290)]]  # shared key, second destination
    expected = [t.clone() for t in local]
    for i in range(150):
        for e, p in zip(expected, peer):
            e[1 + i] = p[(7 * i) % 200]
    for e, p in zip(expected, peer):
        e[290] = p[0]

    c = load_from_peer(local, {0: peer}, rows, SlabConfig(64, 8, 2), kernel)
    for a, b in zip(local, expected):
        assert torch.equal(bits(a), bits(b))
    assert c.transfers == 3 and c.fused_transfers == (3 if fused else 0)
    assert c.blocks_written == 151


def test_negative_control_fused_copy_skipped_is_caught(monkeypatch):
    from xinference.model.llm.vllm.xavier.mechanism import block_copy_triton

    monkeypatch.setattr(block_copy_triton, "gather_scatter", lambda *a, **k: None)
    local, peer = storage(64, 3), storage(64, 4)
    before = [t.clone() for t in local]

    eng = GPUTransfer(0, SlabConfig(32, 8, 2), copy_kernel="triton")
    eng.set_local_caches({0: local})
    eng.map_storage(1, Tier.GPU, {0: peer})
    res = eng.load_gpu_requests_v1(loads([[(0, 9, 1, 0, 5, 6)]])).wait(60)
    torch.cuda.synchronize()
    assert res.blocks_written == 1  # claimed, but:
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(local, before))


def test_triton_kernel_refused_before_copy_when_layout_does_not_fit():
    from xinference.model.llm.vllm.xavier.mechanism.load_handle import LoadRejected

    local = [t.movedim(0, 1).contiguous().movedim(1, 0) for t in storage(32, 1)]  # not block-first
    peer = storage(32, 2)

    eng = GPUTransfer(0, SlabConfig(32, 8, 2), copy_kernel="triton")
    eng.set_local_caches({0: local})
    eng.map_storage(1, Tier.GPU, {0: peer})
    with pytest.raises(LoadRejected, match="^copy_kernel: "):
        eng.load_gpu_requests_v1(loads([[(0, 9, 1, 0, 5, 6)]]))


def test_launch_does_not_wait_and_order_makes_the_stream_see_the_bytes():
    """The engine's host thread never waits for a copy: with the caller's stream busy (a
    spinning kernel), launching returns at once; after ``order`` the caller's stream sees
    the loaded bytes; the load is reportable (vLLM told, the scheduler half's leases
    released) only once the copy ran."""
    local, peer = storage(128, 21), storage(128, 22)
    eng = GPUTransfer(0, SlabConfig(64, 8, 2))
    eng.set_local_caches({0: local})
    eng.map_storage(1, Tier.GPU, {0: peer})

    eng.load_gpu_requests_v1(loads([[(0, 60, 1, 0, 100, 120)]])).wait(60)  # first-use
    torch.cuda.synchronize()  # allocations (slabs, pointer tables, caching allocators) done
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the caller's stream busy
    t0 = time.perf_counter()
    handle = eng.load_gpu_requests_v1(loads([[(0, 70 + i, 1, 0, i, 10 + i) for i in range(64)]]))
    launched_s = time.perf_counter() - t0
    assert launched_s < 0.2 and not handle.reportable and not handle.done
    handle.order(torch.cuda.current_stream())
    same = all(bool(torch.equal(bits(a[10:74]), bits(b[:64]))) for a, b in zip(local, peer))
    assert same  # read on the caller's stream, after the copy
    handle.wait(60)
    assert handle.reportable
    eng.close()


def test_a_load_ordered_after_named_events_only_does_not_wait_for_the_callers_stream():
    """``ordered_after``: the worker's loads (vLLM's asynchronous-load blocks, which no step
    in flight touches) wait for the step's victim saves only, not for the forward still
    running on vLLM's stream: with the caller's stream spinning ~1 s, such a load is
    checked and reportable within a fraction of it, its bytes exact; the default order
    (negative control) is still waiting, so the spin was real; a load ordered after an
    event of a busy side stream waits for that event."""
    local, peer = storage(128, 31), storage(128, 32)
    eng = GPUTransfer(0, SlabConfig(64, 8, 2))
    eng.set_local_caches({0: local})
    eng.map_storage(1, Tier.GPU, {0: peer})
    eng.load_gpu_requests_v1(loads([[(0, 60, 1, 0, 100, 120)]])).wait(60)  # first-use
    torch.cuda.synchronize()

    caller = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the caller's stream busy
    unordered = eng.load_gpu_requests_v1(loads([[(0, 200 + i, 1, 0, 40 + i, 50 + i)
                                                 for i in range(32)]]), ordered_after=[])
    # (after it: the engine's one stream is in order, so this one's wait comes second)
    ordered = eng.load_gpu_requests_v1(loads([[(0, 70 + i, 1, 0, i, 10 + i)
                                               for i in range(32)]]))
    assert unordered.quick and ordered.quick  # device memory only, both
    assert unordered.wait_reportable(0.3)
    assert not ordered.reportable and not caller.query()  # the spin still runs
    torch.cuda.synchronize()
    assert ordered.wait_reportable(60)
    for a, b in zip(local, peer):
        assert torch.equal(bits(a[10:42]), bits(b[:32]))
        assert torch.equal(bits(a[50:82]), bits(b[40:72]))

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)
        busy = torch.cuda.Event()
        busy.record(side)
    after = eng.load_gpu_requests_v1(loads([[(0, 300 + i, 1, 0, 80 + i, 90 + i)
                                             for i in range(8)]]), ordered_after=[busy])
    assert not after.wait_reportable(0.3)  # behind the side stream's spin
    assert after.wait_reportable(60) and not after.failed
    eng.close()


def gpu_tier_writer(cache, slots):
    """Rank 1's snapshot storage with a CUDA tier of ``slots`` blocks, its storage writer
    (no room thread) and the block views of the engine ``cache`` it exports from."""
    from xinference.model.llm.vllm.xavier.mechanism.block_copy import block_view
    from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (
        SnapshotStorage,
        TierConfig,
    )
    from xinference.model.llm.vllm.xavier.mechanism.storage_writer import StorageWriter
    from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory

    layout = layout_of(cache)
    st = SnapshotStorage(1, layout, [TierConfig(Tier.GPU, slots * layout.groups[0].block_bytes,
                                                device="cuda")])
    writer = StorageWriter(1, layout, {Tier.GPU: st.caches(Tier.GPU)}, LocalDirectory(),
                           torch.device("cuda"), stream=torch.cuda.Stream(), room_blocks=0)
    return st, writer, {g: [block_view(t, 0) for t in layers] for g, layers in cache.items()}


def test_victims_are_saved_without_waiting_for_the_forward_in_flight():
    """A step's victims (``after_forward=False``) are copied on the writer's save stream,
    not behind vLLM's forward in flight: with the caller's stream spinning, the save's
    event completes within a fraction of the spin and the tier holds the blocks' bytes;
    an export after the forward (the default, negative control) waits for the spin; the
    caller's stream is ordered after both (vLLM writes none of them before)."""
    cache = {0: storage(32, 41)}
    st, writer, views = gpu_tier_writer(cache, 16)
    writer.export(views, [(0, 1, 1)])  # first use (pointer tables, kernel)
    assert writer.flush(30)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # vLLM's forward in flight, ~1 s
    saved = writer.export(views, [(0, 500 + i, 3 + i) for i in range(4)], after_forward=False)
    exported = writer.export(views, [(0, 600 + i, 10 + i) for i in range(4)])
    assert saved.event is not None and exported.event is not None
    deadline = time.monotonic() + 0.3
    while not saved.event.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert saved.event.query() and not exported.event.query()
    assert writer.flush(60)
    tier = st.caches(Tier.GPU)[0]
    for i in range(4):
        slot = writer.lookup(0, 500 + i)[1]
        assert all(torch.equal(bits(t[slot]), bits(c[3 + i])) for t, c in zip(tier, cache[0]))
    writer.close()


def export_gpu_tier(queue, done):
    """Child process: a snapshot storage with a CUDA tier exports blocks, shares IPC handles."""
    cache = {0: storage(32, 11)}
    st, writer, views = gpu_tier_writer(cache, 8)
    writer.export(views, [(0, 500 + i, 3 + i) for i in range(4)])
    assert writer.flush(30)  # published: the copies' event has completed
    slots = [writer.lookup(0, 500 + i)[1] for i in range(4)]
    queue.put((st.ipc_handles(Tier.GPU), slots))
    done.wait(120)
    writer.close()


def test_snapshot_storage_gpu_tier_over_cuda_ipc():
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import open_ipc

    ctx = torch.multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=export_gpu_tier, args=(queue, done))
    proc.start()
    try:
        handles, slots = queue.get(timeout=120)
        peer = open_ipc(handles)
        source = storage(32, 11)  # the child's engine cache, recreated from its seed
        local = storage(64, 12)
        rows = [[(0, 500 + i, 1, 0, slots[i], 40 + i) for i in range(4)]]

        load_from_peer(local, peer, rows, SlabConfig(8, 2, 2))
        for a, b in zip(local, source):
            assert torch.equal(bits(a[40:44]), bits(b[3:7]))
    finally:
        done.set()
        proc.join(60)


def test_cuda_ipc_storage_from_another_process():
    ctx = torch.multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=produce, args=(queue, done, 128, 5))
    proc.start()
    try:
        peer = queue.get(timeout=120)  # rebuilt from CUDA IPC handles
        expected_src = storage(128, 5)
        local = storage(256, 6)
        rows = [[(0, 50 + i, 1, 0, i, 100 + i) for i in range(64)]]

        c = load_from_peer(local, {0: peer}, rows)
        for a, b in zip(local, expected_src):
            assert torch.equal(bits(a[100:164]), bits(b[:64]))
        assert c.transfers == 2 and c.blocks_written == 64
    finally:
        done.set()
        proc.join(60)


@pytest.mark.parametrize("uva", ["1", "0"])
def test_exports_gather_on_the_gpu_and_demotions_land_in_the_pinned_cpu_tier(uva, monkeypatch):
    """The worker's storage writer on CUDA: a fused gather into the GPU tier (no host
    wait), published once the bytes landed; room made by demoting to a page-locked CPU
    tier (written in place through its CUDA view; with ``XAVIER_UVA=0`` by a host copy);
    the bytes in the storage's own tensors (what peers read) equal the engine blocks."""
    monkeypatch.setenv("XAVIER_UVA", uva)
    from xinference.model.llm.vllm.xavier.mechanism.block_copy import block_view
    from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (
        SnapshotStorage,
        TierConfig,
    )
    from xinference.model.llm.vllm.xavier.mechanism.storage_writer import StorageWriter
    from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory
    from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory

    cache = {0: storage(64, 31)}
    layout = layout_of(cache)
    per_block = layout.groups[0].block_bytes
    st = SnapshotStorage(1, layout, [TierConfig(Tier.GPU, 8 * per_block, device="cuda"),
                                     TierConfig(Tier.CPU, 16 * per_block, shared_memory=True,
                                                pin=True)])
    d = BlockDirectory()
    writer = StorageWriter(1, layout, {t: st.caches(t) for t in st.tiers}, LocalDirectory(d),
                           torch.device("cuda"), stream=torch.cuda.Stream(), room_blocks=4,
                           background_room=False)
    views = {0: [block_view(t, 0) for t in cache[0]]}
    res = writer.export(views, [(0, 100 + i, i) for i in range(8)])
    assert res.exported == 8 and writer.flush(30) and d.num_blocks == 8
    assert writer.make_room(4) == 4  # 4 LRU victims demoted to the CPU tier, then claimed
    res = writer.export(views, [(0, 200 + i, 20 + i) for i in range(4)])
    assert res.exported == 4 and res.skipped_no_slot == 0 and writer.flush(30)
    for key, block in [(100 + i, i) for i in range(8)] + [(200 + i, 20 + i) for i in range(4)]:
        tier, slot, _ = writer.lookup(0, key)
        stored = [block_view(t, 0)[slot].cpu() for t in st.caches(tier)[0]]
        assert all(torch.equal(s, v[block].cpu()) for s, v in zip(stored, views[0])), key
    assert {writer.lookup(0, 100 + i)[0] for i in range(4)} == {Tier.CPU}
    assert writer.sink.snapshot()["uva_tiers_written"] == (1 if uva == "1" else 0)
    assert (writer.views(Tier.CPU, 0)[0].device.type == "cuda") == (uva == "1")
    writer.close()
    st.close()


def test_cuda_views_read_and_write_page_locked_host_memory_in_place(monkeypatch):
    """A CUDA view of registered host memory: a GPU write lands in the host tensor and a
    host write is read by the GPU; an index-less ``cuda`` device is accepted (the view is on
    the current device); unregistered memory and ``XAVIER_UVA=0`` give no view."""
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import pin_host, unpin_host
    from xinference.model.llm.vllm.xavier.mechanism.uva import cuda_views

    host = torch.zeros(64, 32, dtype=torch.int64)
    assert cuda_views({0: [host]}, torch.device("cuda")) is None  # not page-locked
    pinned = pin_host([host])
    try:
        for dev in (torch.device("cuda"), torch.device("cuda", torch.cuda.current_device())):
            views = cuda_views({0: [host]}, dev)
            assert views is not None, dev
        view = views[0][0]
        assert view.device.type == "cuda" and view.shape == host.shape
        src = torch.randint(0, 2**62, (8, 32), dtype=torch.int64, device="cuda")
        view.index_copy_(0, torch.arange(8, 16, device="cuda"), src)
        torch.cuda.synchronize()
        assert torch.equal(host[8:16], src.cpu()) and int(host[:8].abs().sum()) == 0
        host[40] = 7
        assert int(view[40].sum().item()) == 7 * 32
        monkeypatch.setenv("XAVIER_UVA", "0")
        assert cuda_views({0: [host]}, torch.device("cuda")) is None
    finally:
        unpin_host(pinned)


@pytest.mark.parametrize("uva", ["1", "0"])
def test_loads_from_a_page_locked_cpu_tier_are_launched_with_the_step(uva, monkeypatch):
    """A peer's page-locked CPU tier on a CUDA engine is read by the fused kernel through
    its CUDA view, launched with the step (no completion-thread copy); without views the
    completion thread copies it.  Bytes exact either way."""
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import pin_host, unpin_host

    monkeypatch.setenv("XAVIER_UVA", uva)
    local = storage(128, 41)
    peer = storage(96, 42, device="cpu")
    pinned = pin_host(peer)
    try:
        rows = [[(0, 700 + i, 1, int(Tier.CPU), (5 * i) % 96, 10 + i) for i in range(64)]]
        eng = GPUTransfer(0, SlabConfig(32, 8, 2))
        eng.set_local_caches({0: local})
        eng.map_storage(1, Tier.CPU, {0: peer})
        handle = eng.load_gpu_requests_v1(loads(rows))
        # launched with the step (quick): no copy waits for the completion thread, which
        # only checks the reads; without views the thread copies them
        assert handle.quick == (uva == "1")
        handle.wait(60)
        assert not handle.failed
        handle.order(torch.cuda.current_stream())
        torch.cuda.synchronize()
        for a, b in zip(local, peer):
            assert torch.equal(bits(a[10:74]).cpu(),
                               bits(b[torch.tensor([(5 * i) % 96 for i in range(64)])]))
        c = eng.sink.snapshot()
        assert c["uva_storages_mapped"] == (1 if uva == "1" else 0)
        assert c["loads_in_background"] == (0 if uva == "1" else 2)  # per transfer (slab 32)
        assert c["fused_transfers"] == (2 if uva == "1" else 0)
        eng.close()
    finally:
        unpin_host(pinned)


def test_unmapping_a_viewed_host_tier_waits_for_the_loads_reading_it():
    """A page-locked tier read through CUDA views is unregistered by its release: unmapping
    it while a launched load may still read it lets the load finish first."""
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import pin_host, unpin_host

    local, peer = storage(512, 51), storage(512, 52, device="cpu")
    pinned = pin_host(peer)
    seen = []
    try:
        eng = GPUTransfer(0, SlabConfig(512, 8, 2))
        eng.set_local_caches({0: local})
        eng.map_storage(1, Tier.CPU, {0: peer},
                        release=lambda: seen.append(handle.done))
        assert eng.sink.snapshot()["uva_storages_mapped"] == 1
        rows = [[(0, 900 + i, 1, int(Tier.CPU), i, i + 1) for i in range(511)]]  # 0: null
        handle = eng.load_gpu_requests_v1(loads(rows))
        assert eng.unmap_storage(1) == 1
        assert seen == [True]  # released only after the load was done
        for a, b in zip(local, peer):
            assert torch.equal(bits(a[1:]).cpu(), bits(b[:511]))
        eng.close()
    finally:
        unpin_host(pinned)


def _variants(kernel) -> int:
    """Kernels Triton compiled for ``kernel`` so far (its per-device caches)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_warm_compiles_each_layout_pair_once_and_no_step_compiles_again():
    """``block_copy_triton.warm`` compiles the copy for every pair of a worker's block views
    (engine layers, storage tiers); a step's launch then compiles nothing, even with its
    index arrays at an odd offset of their upload (as a step with an odd number of rows
    gets them), and copies exactly."""
    from xinference.model.llm.vllm.xavier.mechanism import block_copy_triton as bct
    from xinference.model.llm.vllm.xavier.mechanism.block_copy import block_view

    engine = [block_view(t, 0) for t in storage(24, 1)]
    tier = [block_view(t, 0) for t in storage(40, 2)]
    wider = [torch.zeros(8, engine[0].shape[1] * 2, dtype=torch.int64, device="cuda")
             for _ in range(LAYERS)]
    wider = [w[:, :engine[0].shape[1]] for w in wider]  # another row stride: its own variant
    assert bct.warm([engine, tier, wider]) >= 2
    compiled = _variants(bct._gather_scatter)
    assert bct.warm([engine, tier, wider]) >= 2 and _variants(bct._gather_scatter) == compiled
    upload = torch.tensor([0, 3, 5, 7, 2, 9, 4], dtype=torch.int64, device="cuda")
    src_idx, dst_idx = upload[1:4], upload[4:7]  # offsets of 8 and 32 bytes
    src_t, dst_t = bct.pointer_table(tier), bct.pointer_table(engine)
    bct.gather_scatter(src_t, dst_t, LAYERS, int(engine[0].shape[1]), tier[0].stride(0),
                       engine[0].stride(0), src_idx, dst_idx)
    torch.cuda.synchronize()
    assert _variants(bct._gather_scatter) == compiled  # nothing compiled in the "step"
    for s, d in zip(tier, engine):
        assert torch.equal(d[dst_idx], s[src_idx])
