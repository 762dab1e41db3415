"""The worker's storage writer on real tensors (CPU here; with XAVIER_TEST_DEVICE=cuda the
engine caches and the GPU tier are on the GPU): exports that never wait, publication only
after the bytes, room made ahead (demotions, claims that respect leases), loads by a peer
bit-exact."""

import contextlib
import os
import threading
import time
from typing import Callable, Dict, Iterator, List

import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism import storage_writer as writer_mod
from xinference.model.llm.vllm.xavier.mechanism.block_copy import block_view
from xinference.model.llm.vllm.xavier.mechanism.gpu_transfer import GPUTransfer
from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.mechanism.quiet_gate import QuietGate
from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import SnapshotStorage, TierConfig
from xinference.model.llm.vllm.xavier.mechanism.storage_writer import (
    ROOM_PERIOD_S,
    StorageWriter,
)
from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.planning.counters import Counters
from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier
from xinference.model.llm.vllm.xavier.planning.plan import SlabConfig

from .kvfixtures import BLOCK_DIM, bits, loads, make_caches, random_bits

N_BLOCKS = 32
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")


class World:
    """Replica A's engine cache and storage (rank 1) with its writer; replica B's cache."""

    def __init__(self, seed: int, gpu_blocks: int, cpu_blocks: int = 0,
                 directory: object = None, room: int = 0,
                 make: Callable[..., Dict[int, List[torch.Tensor]]] = make_caches,
                 block_dim: Dict[int, int] = BLOCK_DIM,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_dim = block_dim
        self.a_cache = make(N_BLOCKS, dtype, gen, DEVICE)
        self.b_cache = make(N_BLOCKS, dtype, gen, DEVICE)
        self.layout = layout_of(self.a_cache, block_dim)
        self.views = {g: [block_view(t, block_dim[g]) for t in ts]
                      for g, ts in self.a_cache.items()}
        per_block = max(g.block_bytes for g in self.layout.groups) * len(self.layout.groups)
        cuda = DEVICE == "cuda"
        tiers = [TierConfig(Tier.GPU, gpu_blocks * per_block, device=DEVICE,
                            shared_memory=not cuda)]
        if cpu_blocks:
            tiers.append(TierConfig(Tier.CPU, cpu_blocks * per_block, shared_memory=True))
        self.storage = SnapshotStorage(1, self.layout, tiers)
        self.d = directory if directory is not None else BlockDirectory()
        self.d.register_rank(1)
        self.counters = Counters()
        self.writer = StorageWriter(
            1, self.layout, {t: self.storage.caches(t) for t in self.storage.tiers},
            LocalDirectory(self.d), torch.device(DEVICE),
            stream=torch.cuda.Stream() if cuda else None, counters=self.counters,
            room_blocks=room, background_room=False, generations=self.storage.generations)

    def export(self, rows):
        res = self.writer.export(self.views, rows)
        assert self.writer.flush(30)
        return res

    def load_on_b(self, keys, dests, group=0):
        """Replica B asks the directory and loads what it gets; leases released after."""
        res = self.d.query(group, keys, exclude_rank=2)
        eng = GPUTransfer(2, SlabConfig(8, 2, 2))
        eng.set_local_caches(self.b_cache, self.block_dim)
        for tier in self.storage.tiers:
            eng.map_storage(1, tier, self.storage.caches(tier))
        rows = [(group, k, loc.rank, loc.tier, loc.slot, dest)
                for k, loc, dest in zip(res.keys, res.locations, dests)]
        eng.load_gpu_requests_v1(loads([rows])).wait(30)
        self.d.release(res.lease_ids)  # the scheduler half's part, once the load is done
        eng.close()
        return res

    def close(self):
        self.writer.close()
        self.storage.close()


def block_of(cache, g, i, block_dim=BLOCK_DIM):
    return [t.select(block_dim[g], i) for t in cache[g]]


def assert_block_equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(bits(a.cpu()), bits(b.cpu()))


def test_export_then_query_then_load_bit_exact():
    w = World(0, gpu_blocks=8)
    r = w.export([(0, 100 + i, 3 + i) for i in range(5)] + [(1, 7, 9)])
    assert r.exported == 6 and w.d.num_blocks == 6
    again = w.export([(0, 100, 3)])
    assert again.already_stored == 1 and again.exported == 0
    twice = w.export([(0, 200, 1), (0, 200, 1)])  # one block named twice in a step
    assert twice.exported == 1 and twice.already_stored == 1 and w.writer.used(Tier.GPU) == 7
    res = w.load_on_b([100, 101, 102, 103, 104, 999], [20, 21, 22, 23, 24])
    assert res.num_hits == 5
    for i in range(5):
        assert_block_equal(block_of(w.b_cache, 0, 20 + i), block_of(w.a_cache, 0, 3 + i))
    assert w.d.outstanding_leases == 0
    snap = w.counters.snapshot()
    assert snap["export_exported"] == 7 and snap["export_published"] == 7
    w.close()
    w.close()


def test_a_full_tier_skips_the_export_instead_of_waiting():
    """No free slot and no room made in time: the block is skipped (a later miss), the
    export returns at once and nothing is published for it."""
    w = World(1, gpu_blocks=3)
    w.export([(0, 1, 1), (0, 2, 2), (0, 3, 3)])
    r = w.export([(0, 4, 4), (0, 5, 5)])
    assert (r.exported, r.skipped_no_slot) == (0, 2)
    assert w.d.num_blocks == 3 and w.writer.lookup(0, 4) is None
    assert w.counters.snapshot()["export_skipped_no_slot"] == 2
    w.close()


def test_make_room_never_reuses_a_leased_slot():
    w = World(2, gpu_blocks=3)
    w.export([(0, 1, 1), (0, 2, 2), (0, 3, 3)])
    held = w.d.query(0, [1], exclude_rank=2)  # a peer is about to read key 1 (the LRU)
    assert w.writer.make_room(2) == 2  # key 1's slot is refused; keys 2 and 3 go
    assert w.writer.lookup(0, 1) is not None and w.writer.lookup(0, 2) is None
    slot = held.locations[0].slot
    r = w.export([(0, 4, 4), (0, 5, 5)])
    assert r.exported == 2 and slot not in {w.writer.lookup(0, k)[1] for k in (4, 5)}
    # the leased slot still holds key 1's bytes
    assert_block_equal([v[slot] for v in w.writer.views(Tier.GPU, 0)],
                       [v[1] for v in w.views[0]])
    assert w.counters.snapshot()["room_claims_refused"] >= 1
    w.d.release(held.lease_ids)
    assert w.writer.make_room(1) == 1 and w.writer.lookup(0, 1) is None  # now it could go
    assert w.d.outstanding_leases == 0
    w.close()


def test_make_room_demotes_ahead_so_the_next_export_only_copies():
    w = World(3, gpu_blocks=4, cpu_blocks=8)
    w.export([(0, 1 + i, 1 + i) for i in range(4)])  # GPU tier full
    assert w.writer.make_room(2) == 2
    assert w.writer.used(Tier.GPU) == 2 and w.writer.used(Tier.CPU) == 2
    assert [w.writer.lookup(0, k)[0] for k in (1, 2, 3, 4)] == [Tier.CPU] * 2 + [Tier.GPU] * 2
    nxt = w.export([(0, 5, 5), (0, 6, 6)])
    assert (nxt.exported, nxt.skipped_no_slot) == (2, 0)
    assert w.writer.make_room(100) == 4  # capped by the tier: all of it, in chunks
    assert w.writer.used(Tier.GPU) == 0 and w.writer.used(Tier.CPU) == 6
    w.load_on_b([1, 2, 3, 4, 5, 6], list(range(20, 26)))
    for i in range(6):  # every block loads from the CPU tier, bit-exact
        assert_block_equal(block_of(w.b_cache, 0, 20 + i), block_of(w.a_cache, 0, 1 + i))
    snap = w.counters.snapshot()
    assert snap["room_demoted"] == 6 and snap["room_evicted"] == 6
    # where the rounds' time went: copies and directory calls, both part of room_us
    assert 0 < snap["room_copy_us"] and 0 < snap["room_directory_us"]
    assert snap["room_copy_us"] + snap["room_directory_us"] <= snap["room_us"]
    assert w.d.outstanding_leases == 0
    w.close()


def mla_caches(n_blocks: int, dtype: torch.dtype, gen: torch.Generator,
               device: str = "cpu") -> Dict[int, List[torch.Tensor]]:
    """vLLM's MLA cache (DeepSeek-V2/V3): per layer one latent cache ``[blocks, tokens,
    kv_lora_rank + qk_rope_head_dim]`` (512 + 64), no K/V split; three layers, one group."""
    return {0: [random_bits((n_blocks, 16, 512 + 64), dtype, gen, device) for _ in range(3)]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8], ids=str)
def test_mla_latent_caches_export_demote_and_load_bit_exact(dtype):
    """An MLA model's caches through the whole path: six blocks exported into the GPU tier,
    two of them demoted to the CPU tier, all six loaded into another replica from both
    tiers, every byte equal.  fp8 KV: vLLM types the cache ``uint8`` or ``float8_e4m3fn``
    by backend."""
    w = World(5, gpu_blocks=4, cpu_blocks=8, make=mla_caches, block_dim={0: 0}, dtype=dtype)
    assert w.layout.groups[0].layers[0].block_shape == (16, 576)
    w.export([(0, 1 + i, 2 + i) for i in range(4)])
    assert w.writer.make_room(2) == 2
    w.export([(0, 5, 9), (0, 6, 11)])
    assert w.writer.used(Tier.GPU) == 4 and w.writer.used(Tier.CPU) == 2
    before = [bits(t.cpu()).clone() for t in w.b_cache[0]]
    res = w.load_on_b([1, 2, 3, 4, 5, 6], list(range(20, 26)))
    assert res.num_hits == 6
    for i, src in enumerate((2, 3, 4, 5, 9, 11)):
        assert_block_equal(block_of(w.b_cache, 0, 20 + i, w.block_dim),
                           block_of(w.a_cache, 0, src, w.block_dim))
    untouched = list(range(0, 20)) + list(range(26, N_BLOCKS))
    for t, b in zip(w.b_cache[0], before):  # nothing else of B's cache was written
        assert torch.equal(bits(t.cpu())[untouched], b[untouched])
    assert w.d.outstanding_leases == 0
    w.close()


def test_a_full_lower_tier_gives_up_its_own_lru_blocks():
    w = World(4, gpu_blocks=2, cpu_blocks=2)
    for step in range(3):
        w.export([(0, 10 + 2 * step + j, 1 + 2 * step + j) for j in range(2)])
        w.writer.make_room(2)
    # 6 blocks passed through a 2-slot GPU tier into a 2-slot CPU tier: the newest 2 stay
    assert w.writer.used(Tier.CPU) == 2 and w.writer.used(Tier.GPU) == 0
    assert {w.writer.lookup(0, k) is not None for k in (14, 15)} == {True}
    assert w.d.num_blocks == 2
    w.close()


def test_blocks_are_published_only_after_their_bytes_and_never_taken_before(monkeypatch):
    """A slow publication: the block is not in the directory yet, and the room thread
    does not take its slot as a victim meanwhile (a claim must not overtake it)."""
    gate = threading.Event()
    d = BlockDirectory()
    w = World(5, gpu_blocks=2, directory=d)
    real = LocalDirectory.register

    def slow_register(self, rank, entries, incarnation=0):
        assert gate.wait(30)
        return real(self, rank, entries, incarnation)

    monkeypatch.setattr(LocalDirectory, "register", slow_register)
    r = w.writer.export(w.views, [(0, 1, 1), (0, 2, 2)])
    assert r.exported == 2
    time.sleep(0.05)
    assert d.num_blocks == 0  # not visible yet
    assert w.writer.make_room(2) == 0  # both pending: no victim
    gate.set()
    assert w.writer.flush(30) and d.num_blocks == 2
    assert w.writer.make_room(2) == 2
    w.close()


def test_background_room_keeps_free_slots_ahead_of_exports(monkeypatch):
    monkeypatch.setattr(writer_mod, "ROOM_PERIOD_S", 0.05)
    gen = torch.Generator().manual_seed(6)
    cache = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)
    lay = layout_of(cache, BLOCK_DIM)
    per_block = max(g.block_bytes for g in lay.groups) * len(lay.groups)
    cuda = DEVICE == "cuda"
    st = SnapshotStorage(1, lay, [TierConfig(Tier.GPU, 8 * per_block, device=DEVICE,
                                             shared_memory=not cuda)])
    d = BlockDirectory()
    writer = StorageWriter(1, lay, {Tier.GPU: st.caches(Tier.GPU)}, LocalDirectory(d),
                           torch.device(DEVICE), stream=torch.cuda.Stream() if cuda else None,
                           room_blocks=2)
    views = {g: [block_view(t, BLOCK_DIM[g]) for t in ts] for g, ts in cache.items()}
    for step in range(6):
        r = writer.export(views, [(0, 100 + 2 * step, 1), (0, 101 + 2 * step, 2)])
        assert r.exported == 2, step  # the room thread freed 2 slots in time
        deadline = time.monotonic() + 10
        while writer.free(Tier.GPU, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    writer.close()
    st.close()
    assert d.num_blocks <= 8


def test_export_of_a_group_not_stored_is_refused_by_name():
    w = World(7, gpu_blocks=2)
    with pytest.raises(ValueError, match="^group: KV-cache group 5 is not stored"):
        w.writer.export(w.views, [(5, 1, 1)])
    w.close()
    with pytest.raises(RuntimeError, match="export: the storage writer of rank 1 is closed"):
        w.writer.export(w.views, [(0, 1, 1)])


def test_a_slot_s_generation_is_bumped_in_the_shared_file_before_its_bytes_are_written(
        monkeypatch):
    """The generations live in the storage's file, which readers map: a peer's view shows
    every export and demotion, and a demotion's destination slots carry their new
    generation before the copy writes them (a reader checking after its copy sees the
    overwrite).  A demotion whose copy fails frees its slots again."""
    from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations

    w = World(3, gpu_blocks=4, cpu_blocks=8)
    reader = SlotGenerations.open(w.storage.generations_handle())  # as a peer maps it
    assert reader.incarnation == w.storage.generations.incarnation != 0
    w.export([(0, 1 + i, 1 + i) for i in range(4)])
    assert reader.row(int(Tier.GPU), 0).tolist() == [1, 1, 1, 1]
    at_copy: List[List[int]] = []
    copy = w.writer._copy_between

    def recording_copy(src_tier, dst_tier, group, src_slots, dst_slots):
        at_copy.append([int(reader.row(int(dst_tier), group)[s]) for s in dst_slots])
        return copy(src_tier, dst_tier, group, src_slots, dst_slots)

    monkeypatch.setattr(w.writer, "_copy_between", recording_copy)
    assert w.writer.make_room(2) == 2
    assert at_copy == [[1, 1]]  # bumped before the bytes went in
    cpu = reader.row(int(Tier.CPU), 0)
    assert sorted(cpu.tolist()) == [0] * 6 + [1, 1]
    for key in (1, 2):  # the directory's rows carry the file's generations
        tier, slot, gen = w.writer.lookup(0, key)
        assert tier == Tier.CPU and gen == int(cpu[slot]) == 1

    def failing_copy(*args):
        raise RuntimeError("copy engine gone")

    monkeypatch.setattr(w.writer, "_copy_between", failing_copy)
    with pytest.raises(RuntimeError, match="copy engine gone"):
        w.writer.make_room(4)  # 2 free already: demotes the other 2
    assert w.writer.used(Tier.CPU) == 2  # the failed demotion's slots are free again
    assert w.writer.free(Tier.CPU) == 6
    assert sorted(cpu.tolist()) == [0] * 4 + [1] * 4  # ... with their generations bumped
    del cpu
    reader.close()
    w.close()


def gated_writer(quiet_s: float, seed: int = 8, slots: int = 16):
    """A writer with a background room (``slots`` GPU slots, room blocks 4: a target of 4
    free with 16 slots) and a CPU tier below, its directory calls and rounds behind a quiet
    gate of ``quiet_s``."""
    gen = torch.Generator().manual_seed(seed)
    cache = make_caches(N_BLOCKS, torch.bfloat16, gen, DEVICE)
    lay = layout_of(cache, BLOCK_DIM)
    per_block = max(g.block_bytes for g in lay.groups) * len(lay.groups)
    cuda = DEVICE == "cuda"
    st = SnapshotStorage(1, lay, [TierConfig(Tier.GPU, slots * per_block, device=DEVICE,
                                             shared_memory=not cuda),
                                  TierConfig(Tier.CPU, slots * per_block, shared_memory=True)])
    d = BlockDirectory()
    d.register_rank(1)
    counters = Counters()
    gate = QuietGate(quiet_s, 30.0, sink=counters)
    writer = StorageWriter(1, lay, {t: st.caches(t) for t in st.tiers}, LocalDirectory(d),
                           torch.device(DEVICE), stream=torch.cuda.Stream() if cuda else None,
                           counters=counters, room_blocks=4, quiet=gate)
    views = {g: [block_view(t, BLOCK_DIM[g]) for t in ts] for g, ts in cache.items()}
    return writer, st, d, counters, views


@contextlib.contextmanager
def loads_launched(gate: QuietGate) -> Iterator[None]:
    """While inside, a worker launching a load every 10 ms (its own thread)."""
    stop = threading.Event()

    def launching() -> None:
        while not stop.is_set():
            gate.busy()
            time.sleep(0.01)
    busy = threading.Thread(target=launching, daemon=True)
    busy.start()
    try:
        yield
    finally:
        stop.set()
        busy.join()


@pytest.mark.parametrize("quiet_s", [0.8, 0.0])
def test_room_and_registrations_wait_while_loads_are_launched_then_go(quiet_s):
    """A worker launching loads every 10 ms: the room's round and the registration of 13
    exported blocks wait until it is quiet (negative control, the gate off: both at once)."""
    writer, st, d, counters, views = gated_writer(quiet_s)
    with loads_launched(writer.quiet):
        writer.export(views, [(0, 100 + i, i) for i in range(13)])  # 3 free: below the target
        time.sleep(1.0)
        during = (d.num_blocks, counters.get("room_rounds"))
    deadline = time.monotonic() + 10
    while (d.num_blocks < 13 or writer.free(Tier.GPU, 0) < 4) and time.monotonic() < deadline:
        time.sleep(0.01)
    after = (d.num_blocks, counters.get("room_rounds"), writer.free(Tier.GPU, 0))
    writer.close()
    st.close()
    if quiet_s:
        assert during == (0, 0), "registration or room round ran while loads were launched"
        assert counters.get("background_deferrals") >= 1
    else:
        assert during[0] == 13 and during[1] >= 1
    assert after[0] == 13 and after[1] >= 1 and after[2] >= 4


@pytest.mark.parametrize("guard", [True, False])
def test_a_room_round_with_nothing_to_free_is_not_held_back(guard):
    """The room thread wakes every ROOM_PERIOD_S: with the top tier's free slots at the
    target (2 of 16 exported, registered) its round frees nothing and is not counted as
    deferred work while loads are launched; the negative control, every round taken for
    work (the guard off): the same wakes are held back and counted."""
    writer, st, d, counters, views = gated_writer(5.0)
    checked = []
    real = writer._room_below

    def room_below(share: float) -> bool:
        checked.append(share)
        return real(share) if guard else share == 1  # (the control: wanted, never short)
    writer._room_below = room_below
    writer.export(views, [(0, 100 + i, i) for i in range(2)])
    assert writer.flush(10) and d.num_blocks == 2  # (the registration: not in the count)
    base = counters.get("background_deferrals")
    with loads_launched(writer.quiet):
        time.sleep(2 * ROOM_PERIOD_S + 0.3)
        writer.quiet.close()  # (lets a held round go)
    held = counters.get("background_deferrals") - base
    writer.close()
    st.close()
    assert 1 in checked  # (the room thread woke and asked in the window)
    assert (held == 0) if guard else (held >= 1)


def test_a_flush_or_a_tier_short_of_room_does_not_wait_for_quiet():
    writer, st, d, counters, views = gated_writer(5.0)
    writer.quiet.busy()
    writer.export(views, [(0, 100 + i, i) for i in range(13)])  # 3 free: not short
    time.sleep(2 * ROOM_PERIOD_S)
    assert (writer.free(Tier.GPU, 0), d.num_blocks) == (3, 0)  # both wait for quiet
    t0 = time.monotonic()
    assert writer.flush(10)  # hurried: the registration now
    assert time.monotonic() - t0 < 3.0 and d.num_blocks == 13
    with writer.quiet.hurried():  # (what a flush does) the held room round goes too; (the
        # flush's own round may have run before the registration: no victim was free then)
        deadline = time.monotonic() + 3.0
        while writer.free(Tier.GPU, 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert writer.free(Tier.GPU, 0) >= 4
    writer.quiet.busy()
    writer.export(views, [(0, 200 + i, 13 + i) for i in range(3)], after_forward=False)
    deadline = time.monotonic() + 3.0  # 1 free, under half the target: the room goes now
    while writer.free(Tier.GPU, 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.free(Tier.GPU, 0) >= 4
    writer.close()
    st.close()


@pytest.mark.parametrize("control, save", [(False, 4), (False, 5), (True, 4)])
def test_one_step_s_save_leaves_the_room_round_waiting_for_quiet(monkeypatch, control, save):
    """The room keeps two saves of ``room_blocks`` (4) free: a hit's step saving that many
    victims while loads are launched leaves the tier at half its target, not short, so the
    round waits for quiet instead of running beside the hit (H200, session 44: with one
    save's worth every save made the round urgent, and the quiet gate changed nothing).  A
    save of one block more leaves less than the next save needs: the round goes at once.
    Negative control, a target of one save: the same save empties it and the round runs."""
    if control:
        monkeypatch.setattr(writer_mod, "ROOM_TARGET_SAVES", 1)
    writer, st, d, counters, views = gated_writer(5.0, slots=64)
    target = writer._room_target
    assert target == (4 if control else 8)
    writer.export(views, [(0, 1000 + i, i % N_BLOCKS) for i in range(64 - target)])
    assert writer.flush(10) and writer.free(Tier.GPU, 0) == target  # (at the target: no round)
    rounds = counters.get("room_rounds")
    held = not control and save == 4
    with loads_launched(writer.quiet):
        writer.export(views, [(0, 2000 + i, i) for i in range(save)], after_forward=False)
        deadline = time.monotonic() + (1.0 if held else 10.0)
        while time.monotonic() < deadline and (held or counters.get("room_rounds") == rounds
                                               or writer.free(Tier.GPU, 0) < target):
            time.sleep(0.01)
        during = (counters.get("room_rounds") - rounds, writer.free(Tier.GPU, 0))
        writer.quiet.close()  # (lets a held round go before the writer closes)
    writer.close()
    st.close()
    if held:
        assert during == (0, target - save), "a round ran beside the hit's load"
    else:
        assert during[0] >= 1 and during[1] >= target, during
