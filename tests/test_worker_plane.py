"""The worker's data plane: loads the scheduler could not express are reported failed, and its
peers (retries after a failed mapping, world updates) through :class:`PeerMaps`."""

import threading
import time
from types import SimpleNamespace

import numpy as np

from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (
    SnapshotStorage,
    TierConfig,
)
from xinference.model.llm.vllm.xavier.planning.load_batch import COLUMNS, LoadBatch, Tier
from xinference.model.llm.vllm.xavier.planning.options import XavierOptions
from xinference.model.llm.vllm.xavier.planning.step_meta import StepMeta
from xinference.model.llm.vllm.xavier.vllm_side import peers
from xinference.model.llm.vllm.xavier.vllm_side.actor_bridge import ActorBridge
from xinference.model.llm.vllm.xavier.vllm_side.worker_plane import WorkerDataPlane

from .kvfixtures import engine_cache, opts


def plane_of(rank=2, defers_block_frees=False, overlapped=True, **kw):
    cache, _, _ = engine_cache(16)
    options = opts(**kw)
    options = XavierOptions(**{**vars(options), "rank": rank})
    return WorkerDataPlane(options, ActorBridge.shared(), {0: [(f"l{i}", t) for i, t in
                                                               enumerate(cache[0])]}, {0: 0},
                           defers_block_frees=defers_block_frees, overlapped=overlapped)


def refusing_describe(seen):
    """A peer's descriptor call that every peer refuses (``seen(rank)`` is told first), but
    the launch's coordinator, which holds no storage."""
    def describe(rank, address):
        if rank == 0:
            return None
        seen(rank)
        raise ConnectionRefusedError("peer refused")

    return describe


def test_unmappable_peer_is_not_looked_up_again_until_retry_time_or_new_address(monkeypatch):
    """A dead peer costs one failed try, not one per step: the next after PEER_RETRY_S,
    doubling with each failure in a row; a world update that gives it a new address
    (recovery) allows the next try at once."""
    plane = plane_of()
    plane.peers.apply_world(["m", "127.0.0.1:1", "127.0.0.1:3"])
    tries = []
    monkeypatch.setattr(plane.peers, "_describe", refusing_describe(tries.append))
    clock = [100.0]
    monkeypatch.setattr(peers, "_monotonic", lambda: clock[0])
    assert plane.peers.ensure_mapped({1}) == {1}
    assert plane.peers.ensure_mapped({1}) == {1}  # within the wait: not tried
    plane.peers.premap()  # (nor by the mapping thread, which the load woke)
    assert tries == [1]
    clock[0] += peers.PEER_RETRY_S + 0.1
    assert plane.peers.ensure_mapped({1}) == {1}
    assert tries == [1, 1]
    clock[0] += peers.PEER_RETRY_S + 0.1  # a second failure in a row doubled the wait
    assert plane.peers.ensure_mapped({1}) == {1}
    assert tries == [1, 1]
    plane.peers.apply_world(["m", "127.0.0.1:2", "127.0.0.1:3"])  # recovered elsewhere
    assert plane.peers.ensure_mapped({1}) == {1}
    assert tries == [1, 1, 1]
    assert plane.counters.snapshot()["peer_map_failures"] == 3
    plane.close()


def test_the_step_thread_never_describes_a_peer_of_another_address_host(monkeypatch):
    """A load naming a peer not mapped yet whose address is on another host (CI once saw
    its first describe take 17 s, on vLLM's step thread): its rows fail at once and the
    mapping thread describes and sets it up; a peer on this rank's own address host is
    still described at once.  Control: the same peer moved to this host's address."""
    plane = plane_of()
    plane.peers.apply_world(["m", "10.77.0.2:1", "10.77.0.1:3"])
    described = []
    monkeypatch.setattr(plane.peers, "_describe", refusing_describe(lambda rank: described.append(
        (rank, threading.current_thread() is threading.main_thread()))))
    monkeypatch.setattr(plane.peers, "_premap_failed", lambda rank, exc: None)
    assert plane.peers.ensure_mapped({1}) == {1}
    assert described == []  # not on the step's thread
    assert 1 in plane.peers._wanted  # asked of the mapping thread instead
    mapper = threading.Thread(target=plane.peers.premap)
    mapper.start()
    mapper.join(10)
    assert described == [(1, False)]
    plane.peers.apply_world(["m", "10.77.0.1:1", "10.77.0.1:3"])  # now on this host's address
    assert plane.peers.ensure_mapped({1}) == {1}
    assert described == [(1, False), (1, True)]
    plane.close()


def test_a_dark_host_never_holds_the_step_thread(monkeypatch):
    """Setting up a peer whose host answers nothing (blackholed: the call runs to its
    timeout) happens on the mapping thread only, without the lock loads take: while the
    thread is inside that call, the step's thread is answered at once -- the peer's rows
    fail, a tier refresh is queued, a world update is read from the rank's own actor --
    and no step waits."""
    plane = plane_of()
    world = ["m", "dark-host:1", "b"]
    plane.peers.apply_world(world)
    inside, release = threading.Event(), threading.Event()

    class Own:  # this rank's transfer actor (answers) and the dark peer behind it
        def map_remote(self, rank):
            return "hang"

        def world(self):
            return list(world)

    class Bridge:
        def call(self, make, timeout=None):
            result = make()
            if result == "hang":
                inside.set()
                release.wait(30)  # (xoscar's connect timeout, the bridge's 10 s, for real)
                raise TimeoutError("no answer from dark-host")
            return result

    def describe(rank, address):  # the descriptor arrived while the host lived
        return None if rank == 0 else {"host": "another host", "tiers": {},
                                       "layout": plane.layout}

    monkeypatch.setattr(plane.peers, "_describe", describe)
    monkeypatch.setattr(plane.peers, "_bridge", Bridge())
    monkeypatch.setattr(plane.peers._transfer, "get", lambda timeout=None: Own())
    plane.peers.premap()  # the mapping thread saw the peer (of another host) while it lived
    assert plane.peers.ensure_mapped({1}) == {1}  # a load asked: the thread sets it up next
    mapper = threading.Thread(target=plane.peers.premap)
    mapper.start()
    try:
        assert inside.wait(10), "the mapping thread never reached the dark peer"
        t0 = time.perf_counter()
        for _ in range(100):  # a hundred steps while the peer hangs
            assert plane.peers.ensure_mapped({1}) == {1}
            plane.peers.refresh(1)
            plane.counters.add("world_epoch", 1)
        assert time.perf_counter() - t0 < 1.0
        assert mapper.is_alive() and not release.is_set()  # (the hang lasted throughout)
    finally:
        release.set()
        mapper.join(30)
    assert plane.counters.snapshot()["peer_map_failures"] == 1
    plane.close()


def test_a_peer_whose_read_failed_is_kept_out_of_loads_for_a_while(monkeypatch):
    """A read from a mapped peer of another host that got no answer (its host went dark:
    the call ran to its timeout on the one completion thread) keeps the peer's rows out of
    loads for FETCH_RETRY_S, doubling with each such failure in a row; a read of it planned
    before fails at once without counting; a read that works ends the keep-out and the
    doubling, so does a world update that moves the peer, and a failure long after the
    last keep-out starts the doubling again; a read refused for this rank's own reasons
    (staging rows busy) keeps nobody out."""
    from xinference.model.llm.vllm.xavier.mechanism.remote_fetch import StagingBusyError
    from xinference.model.llm.vllm.xavier.vllm_side import remote_reads

    plane = plane_of()
    plane.peers.apply_world(["m", "other-host:1", "b"])
    monkeypatch.setattr(plane.engine, "mapped", lambda: {(1, Tier.CPU)})
    clock = [100.0]
    monkeypatch.setattr(remote_reads, "_monotonic", lambda: clock[0])
    outcome = [TimeoutError("actor call did not finish within 30.0 s")]
    calls = []

    class Own:
        async def fetch_blocks(self, rank, tier, group, slots, tp_rank):
            calls.append(rank)
            if outcome[0] is not None:
                raise outcome[0]
            return (len(slots), 7, [1] * len(slots)), 0

    plane.peers.reads._staging = {0: {0: [np.zeros((4, 8), np.uint8)]}}
    fetch = plane.peers.reads.reader(Own(), 1, Tier.CPU)

    class Transfer:
        src_slots, group = np.array([0, 1]), 0

    def read_fails(exc_type):
        try:
            fetch(Transfer())
        except exc_type:
            return True
        return False

    def kept_out_after(seconds):
        clock[0] += seconds
        return plane.peers.ensure_mapped({1}) == {1}

    try:
        assert plane.peers.ensure_mapped({1}) == set()  # mapped, no failure yet
        assert read_fails(TimeoutError)
        assert kept_out_after(0)  # its rows recompute at once
        assert read_fails(remote_reads.PeerKeptOutError) and calls == [1]  # planned before
        assert not kept_out_after(remote_reads.FETCH_RETRY_S + 0.1)
        outcome[0] = ConnectionRefusedError("refused")
        assert read_fails(ConnectionRefusedError)  # a second failure in a row: 10 s
        assert kept_out_after(remote_reads.FETCH_RETRY_S + 0.1)
        assert not kept_out_after(remote_reads.FETCH_RETRY_S)
        outcome[0] = None
        assert fetch(Transfer()).identity.incarnation == 7  # it answers again
        outcome[0] = TimeoutError("again")
        assert read_fails(TimeoutError)  # the doubling started again: 5 s
        assert not kept_out_after(remote_reads.FETCH_RETRY_S + 0.1)
        assert read_fails(TimeoutError)  # in a row: 10 s ...
        assert not kept_out_after(2 * remote_reads.FETCH_RETRY_S + 0.1)
        clock[0] += remote_reads.FETCH_RETRY_MAX_S + 1  # ... but long after the last one
        assert read_fails(TimeoutError)
        assert not kept_out_after(remote_reads.FETCH_RETRY_S + 0.1)
        assert read_fails(TimeoutError)
        assert kept_out_after(0.1)
        plane.peers.apply_world(["m", "other-host:2", "b"])  # recovered elsewhere
        assert not kept_out_after(0)
        outcome[0] = StagingBusyError("both staging row sets in use")
        assert read_fails(StagingBusyError)
        assert not kept_out_after(0)  # not the peer's failure
        assert plane.counters.snapshot()["peers_kept_out"] == 6
    finally:
        plane.close()


def test_a_read_waiting_on_a_peer_that_left_the_world_is_abandoned_at_once():
    """A read of a peer of another host waits (its host went dark, the call has 30 s); a
    world update without that peer (the registry dropped its ranks) abandons it at once:
    the load fails and vLLM recomputes, ~10 s after the host went dark instead of after the
    timeout.  Control: before the update the read is still waiting after a second."""
    import asyncio

    from xinference.model.llm.vllm.xavier.vllm_side import remote_reads

    plane = plane_of()
    plane.peers.apply_world(["m", "other-host:1", "b"])
    answered = threading.Event()

    class Own:
        async def fetch_blocks(self, rank, tier, group, slots, tp_rank):
            await asyncio.sleep(60)  # a dark host: no answer, no refusal
            answered.set()

    plane.peers.reads._staging = {0: {0: [np.zeros((4, 8), np.uint8)]}}
    fetch = plane.peers.reads.reader(Own(), 1, Tier.CPU)

    class Transfer:
        src_slots, group = np.array([0, 1]), 0

    outcome = {}

    def read():
        t0 = time.monotonic()
        try:
            fetch(Transfer())
        except Exception as exc:
            outcome["error"] = exc
        outcome["s"] = time.monotonic() - t0

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not plane.peers.reads._waiting.get(1):  # (the read was sent)
            assert time.monotonic() < deadline, "the read never started"
            time.sleep(0.01)
        reader.join(1.0)
        assert reader.is_alive() and not outcome  # the control: the read really waits
        plane.peers.apply_world(["m", "", "b"])  # the registry dropped rank 1
        reader.join(5)
        assert isinstance(outcome.get("error"), remote_reads.PeerLeftError), outcome
        assert outcome["s"] < 3 and not answered.is_set()
        snap = plane.counters.snapshot()
        assert snap["remote_reads_abandoned"] == 1 and snap["peers_kept_out"] == 0
        assert plane.peers.reads.abandon(1) == 0  # (nothing left to abandon)
    finally:
        plane.close()
        reader.join(5)


def test_a_steps_levels_reach_the_counters_down_to_zero_where_zero_is_a_level():
    """``host_index_peers`` falls back to 0 when the last same-host peer goes (it stayed at
    its last value before session 28); a step without a host index (-1) leaves it; the cost
    model's estimates, 0 while unknown, keep their last known value."""
    plane = plane_of()
    try:
        plane.add_step_stats({"host_index_peers": 2, "cost_hit_wait_us": 900, "hit_blocks": 3})
        plane.add_step_stats({"host_index_peers": 0, "cost_hit_wait_us": 0, "hit_blocks": 2})
        got = plane.counters.snapshot()
        assert (got["host_index_peers"], got["cost_hit_wait_us"], got["hit_blocks"]) == (0, 900, 5)
        plane.add_step_stats({"host_index_peers": 1})
        plane.add_step_stats({"host_index_peers": -1})
        assert plane.counters.snapshot()["host_index_peers"] == 1
    finally:
        plane.close()


def test_premapping_maps_this_hosts_peers_once_and_leaves_other_hosts_to_their_loads(
        monkeypatch):
    """The mapping thread's pass (:meth:`PeerMaps.premap`): every peer of the world that
    is not mapped yet, never this rank, from its real shared-memory storage; a peer of
    another host is not mapped (its first load does that through the actor) and not asked
    again until its address changes; a peer that cannot be described is retried later; a
    peer whose second tier cannot be opened is not left half mapped; a second pass maps
    nothing; a world update that moves a peer maps it again."""
    plane = plane_of()
    lay = plane.layout
    per_block = lay.groups[0].block_bytes
    storage = SnapshotStorage(1, lay, [
        TierConfig(Tier.GPU, 4 * per_block, shared_memory=True),
        TierConfig(Tier.CPU, 4 * per_block, shared_memory=True)])
    plane.peers.apply_world(["h:0", "h:1", "me", "other-host:3", "h:4", "h:5"])
    asked = []

    def describe(rank, address):
        asked.append(rank)
        if rank == 0:  # the launch's rank-0 coordinator: no storage
            return None
        if rank == 4:
            raise ConnectionRefusedError("rank 4 is not answering")
        tiers = storage.handles()
        if rank == 5:  # its CPU tier cannot be opened here (a kind this build lacks)
            tiers[int(Tier.CPU)] = ("rdma-window", tiers[int(Tier.CPU)][1])
        host = "another host" if rank == 3 else plane.peers._host
        return {"host": host, "tiers": tiers, "layout": lay,
                "generations": storage.generations_handle()}

    monkeypatch.setattr(plane.peers, "_describe", describe)
    assert plane.peers.premap() == {4, 5}
    assert sorted(asked) == [0, 1, 3, 4, 5]
    both = [(r, t) for r in (1,) for t in (Tier.GPU, Tier.CPU)]
    assert sorted(plane.engine.mapped()) == both  # rank 5: whole or not at all
    # 0 holds no storage, 3 is remote, 4 and 5 wait for the mapping thread's next try
    assert plane.peers.premap() == set() and len(asked) == 5
    plane.peers.apply_world(["h:0", "h:1b", "me", "other-host:3", "h:4", "h:5"])  # 1 moved
    assert sorted(plane.engine.mapped()) == []
    plane.peers.premap()
    assert asked[5:] == [1] and sorted(plane.engine.mapped()) == both
    snap = plane.counters.snapshot()
    # the mapping thread's failures are its own: loads were never held back by them
    assert snap["peer_premap_failures"] == 2 and snap["peer_map_failures"] == 0
    assert snap["peers_mapped_ipc"] == 2 and snap["peer_map_us"] > 0
    plane.close()
    assert plane.peers.premap() == set()  # closed: maps nothing
    storage.close()


def test_a_peer_not_mapped_ahead_is_mapped_once_a_load_asked_for_it(monkeypatch):
    """A peer that the mapping thread found not ready (its engine still starting, as when
    two replicas launch together), or of another host (left to its first load), is
    mapped by the thread's next pass once a load asked for it, whatever the thread's own
    retry wait: the first hits after a launch on two hosts are not all recomputed."""
    plane = plane_of()
    plane.peers.apply_world(["h:0", "other-host:1", "me"])
    ready = [False]
    mapped = []

    def describe(rank, address):
        if not ready[0]:
            raise RuntimeError(f"rank {rank}: no storage (engine not registered)")
        return {"host": "another host", "tiers": {}, "layout": plane.layout}

    def map_peer(rank, remote=True, desc=None):
        if remote:
            mapped.append(rank)
            plane.engine.map_remote_storage(rank, Tier.CPU, plane.layout, lambda t: None)
        return remote

    monkeypatch.setattr(plane.peers, "_describe", describe)
    monkeypatch.setattr(plane.peers, "_map_peer", map_peer)
    assert plane.peers.premap() == {0, 1}
    ready[0] = True
    assert plane.peers.ensure_mapped({1}) == {1} and mapped == []  # the load: fails fast
    assert plane.peers.premap() == set() and mapped == [1]  # the thread: maps it now
    assert plane.peers.ensure_mapped({1}) == set()
    snap = plane.counters.snapshot()
    assert snap["peer_premap_failures"] == 2 and snap["peer_map_failures"] == 0
    plane.close()


def test_a_world_update_drops_the_mappings_of_ranks_whose_address_changed():
    plane = plane_of()
    cache, _, _ = engine_cache(8)
    plane.peers.apply_world(["m", "h:1", "h:2", "h:3"])
    for rank in (1, 3):
        plane.engine.map_storage(rank, Tier.CPU, cache)
    plane.peers.apply_world(["m", "h:1", "h:2", ""])  # rank 3 died
    assert plane.engine.mapped() == [(1, Tier.CPU)]
    plane.close()
    plane.close()  # idempotent


def test_loads_the_scheduler_could_not_express_are_reported_failed():
    """``StepMeta.failed_dests`` (the scheduler's defect path): the requests are reported
    finished once, their blocks failed, so vLLM recomputes them and nothing waits."""
    plane = plane_of()
    empty = LoadBatch(("r", "s"), np.zeros(3, np.int64), np.zeros((0, len(COLUMNS)), np.int64))
    plane.load(StepMeta(empty, failed_dests=(5, 6)))
    assert plane.finished() == ({"r", "s"}, {5, 6})
    assert plane.finished() == (set(), set())
    plane.close()


def test_a_remote_fetch_returns_the_rows_of_the_staging_set_its_answer_names():
    """The rank's actor answers a read from another host with the row set that holds the
    bytes (a second set once a timed-out read still ran: tests/test_remote_fetch.py): the
    worker copies that set's rows, mapping it on first sight, and set 0 otherwise."""
    import torch

    from xinference.model.llm.vllm.xavier.mechanism.remote_fetch import StagingSets

    plane = plane_of()
    layout = plane.layout
    sets = StagingSets(layout, 4)
    with sets.taken(), sets.taken():  # allocate the second set
        pass
    for index in (0, 1):
        for t in sets.rows(index, 0, 4):
            t.fill_(0x10 + index)
    answers = []

    class Own:
        async def fetch_blocks(self, rank, tier, group, slots, tp_rank):
            return (len(slots), 77, [5] * len(slots)), answers.pop(0)

        async def staging_handles(self, tp_rank, index):
            return sets.handles(index)

    plane.peers.opened({"staging": sets.handles(0), "host": "h", "world": []})
    fetch = plane.peers.reads.reader(Own(), 1, Tier.CPU)

    class Transfer:
        src_slots, group = np.array([0, 1]), 0

    try:
        for index in (0, 1, 1, 0):
            answers.append(index)
            fetched = fetch(Transfer())
            assert fetched.identity.incarnation == 77  # the source's answer, for the check
            assert fetched.identity.generations.tolist() == [5, 5]
            rows = fetched.staging
            assert len(rows) == len(layout.groups[0].layers)
            assert all(r.shape[0] == 2 and bool((r == 0x10 + index).all()) for r in rows)
        assert sorted(plane.peers.reads._staging) == [0, 1]
        assert isinstance(rows[0], torch.Tensor)
    finally:
        plane.close()
        sets.close()


def test_loads_skip_the_forward_in_flight_only_where_vllms_scheduler_defers_frees():
    """A load and a victim save may skip the forward in flight only where this engine's
    scheduler keeps freed blocks out of the pool while a step in flight may write them:
    vLLM's condition (a KV consumer with several batches in flight), not the mere presence
    of the code; and only with vLLM's cache read in place."""
    from types import SimpleNamespace

    from xinference.model.llm.vllm.xavier.vllm_side.connector_worker import (
        vllm_defers_block_frees,
    )

    def config(role_consumer, batches):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=role_consumer),
                               max_concurrent_batches=batches)

    assert vllm_defers_block_frees(config(True, 2))  # Xavier's kv_both, async scheduling
    assert not vllm_defers_block_frees(config(True, 1))  # no batch in flight: ordered
    assert not vllm_defers_block_frees(config(False, 2))  # a producer: vLLM frees at once
    assert not vllm_defers_block_frees(SimpleNamespace(kv_transfer_config=None))
    assert plane_of(xavier_in_place=True, defers_block_frees=True).unordered
    assert not plane_of(xavier_in_place=False, defers_block_frees=True).unordered
    assert not plane_of(xavier_in_place=True, defers_block_frees=False).unordered
    # vLLM's ask waits for quick loads unless their copies wait for a forward in flight
    assert plane_of(xavier_in_place=True, defers_block_frees=True).report_waits
    assert not plane_of(xavier_in_place=False, defers_block_frees=True).report_waits
    assert plane_of(xavier_in_place=False, overlapped=False).report_waits  # CPU: sync


def test_the_step_loads_are_ordered_after_the_victim_saves_only(monkeypatch):
    """The plane hands the engine the step's victim-save event (and nothing queued on
    vLLM's stream) when it may skip the forward in flight; else the default order.  Each
    launch, and each victim save, tells the writer's quiet gate (its background work
    waits)."""
    cache, _, _ = engine_cache(16)
    for unordered, expected in ((True, ["saved"]), (False, None)):
        plane = plane_of()
        plane.unordered = unordered
        busy: list = []
        plane._attached = True
        plane.writer = SimpleNamespace(quiet=SimpleNamespace(busy=lambda b=busy: b.append(1)))
        plane.engine.map_storage(1, Tier.CPU, cache)
        monkeypatch.setattr(plane.peers, "follow_world", lambda: None)
        monkeypatch.setattr(plane.peers, "ensure_mapped", lambda ranks: set())
        seen: list = []
        monkeypatch.setattr(plane.engine, "load_gpu_requests_v1",
                            lambda batch, ordered_after=None, seen=seen: seen.append(
                                ordered_after))
        rows = np.array([[0, 7, 1, int(Tier.CPU), 3, 5, 0, 0]], np.int64)
        plane.load(StepMeta(LoadBatch(("r",), np.array([0, 1]), rows)), "saved")
        assert seen == [expected] and busy == [1]
        plane.writer.export = lambda views, rows, after_forward: SimpleNamespace(event="ev")
        assert plane.save([(0, 7, 5)]) == "ev" and busy == [1, 1]  # a save marks it too
        plane.writer = None
        plane.close()


class _Handle:
    """A launched load as the plane sees it, checked after ``delay`` s (0: already; None:
    never)."""

    def __init__(self, delay):
        import threading

        self.quick, self.failed, self._done = True, set(), threading.Event()
        if delay == 0:
            self._done.set()
        elif delay is not None:
            threading.Timer(delay, self._done.set).start()

    @property
    def reportable(self):
        return self._done.is_set()

    def wait_reportable(self, timeout=None):
        return self._done.wait(timeout)

    def order(self, stream):
        pass


def test_a_quick_load_is_reported_when_vllm_first_asks_and_a_stuck_one_costs_one_wait():
    """vLLM asks right after launching the forward: the plane waits (at most
    ``REPORT_WAIT_S``) for the quick loads just launched, so they are reported in this
    step; one not checked in time is reported later, counted late once, and not waited for
    again at every later step."""
    from xinference.model.llm.vllm.xavier.vllm_side import worker_plane
    from xinference.model.llm.vllm.xavier.vllm_side.worker_plane import _StepLoad

    plane = plane_of()
    plane.report_waits = True
    # (the quick one checked by the time vLLM asks: a timer of a fraction of the 2 ms wait
    # fired late on a loaded 2-core machine, and the test saw it late)
    plane._pending = [_StepLoad(("fast",), [_Handle(0)]),
                      _StepLoad(("stuck",), [_Handle(None)])]
    t0 = time.perf_counter()
    assert plane.finished() == ({"fast"}, set())
    first = time.perf_counter() - t0
    assert first >= worker_plane.REPORT_WAIT_S * 0.9  # it waited for the stuck one too
    t0 = time.perf_counter()
    assert plane.finished() == (set(), set())
    assert time.perf_counter() - t0 < worker_plane.REPORT_WAIT_S / 2  # not again
    c = plane.counters.snapshot()
    assert c["loads_reported_at_once"] == 1 and c["report_wait_missed"] == 1
    plane._pending[0].handles[0]._done.set()
    assert plane.finished() == ({"stuck"}, set())
    assert plane.counters.snapshot()["loads_reported_at_once"] == 1  # it was late
    plane.close()


def test_a_step_with_no_forward_waits_for_a_load_in_flight_instead_of_going_round_again(
        monkeypatch):
    """While requests wait for their loads and nothing else runs, vLLM runs one empty step
    after another (only the connector is called); such a step (``idle``) waits, at most
    ``IDLE_WAIT_S``, until one load in flight is done -- a slow read of another host
    included -- so that the loop leaves the cores to the transfer.  It ends at the first
    load done (a quick one is not held back by a slow one); a step with a forward does
    not wait for a slow load."""
    import threading

    from xinference.model.llm.vllm.xavier.vllm_side import worker_plane
    from xinference.model.llm.vllm.xavier.vllm_side.worker_plane import _StepLoad

    monkeypatch.setattr(worker_plane, "IDLE_WAIT_S", 0.3)
    plane = plane_of()
    plane.report_waits = True
    remote = _Handle(None)
    remote.quick = False  # checked on the completion thread (a read of another host)
    plane._pending = [_StepLoad(("remote",), [remote])]
    t0 = time.perf_counter()
    assert plane.finished() == (set(), set())  # a step with a forward
    assert time.perf_counter() - t0 < 0.1
    t0 = time.perf_counter()
    assert plane.finished(idle=True) == (set(), set())  # nothing done: the whole budget
    assert time.perf_counter() - t0 >= 0.3 * 0.9
    # a quick load done 20 ms in, behind the slow one: the wait ends there, it is reported
    plane._pending.append(_StepLoad(("local",), [_Handle(0.02)]))
    t0 = time.perf_counter()
    assert plane.finished(idle=True) == ({"local"}, set())
    assert 0.015 <= time.perf_counter() - t0 < 0.2
    threading.Timer(0.05, remote._done.set).start()
    t0 = time.perf_counter()
    assert plane.finished(idle=True) == ({"remote"}, set())  # the read completes 50 ms in
    assert 0.04 <= time.perf_counter() - t0 < 0.25
    waited = plane.counters.snapshot()["idle_wait_us"]
    assert 0.3e6 * 0.9 + 0.015e6 + 0.04e6 <= waited < 0.7e6
    t0 = time.perf_counter()
    assert plane.finished(idle=True) == (set(), set())  # nothing in flight: no wait
    assert time.perf_counter() - t0 < 0.05
    assert plane.counters.snapshot()["idle_wait_us"] == waited
    plane.close()
