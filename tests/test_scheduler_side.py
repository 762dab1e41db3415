"""The connector's scheduler half without vLLM: lookups beyond the local hit, leases,
destinations (null blocks skipped), one load batch per step, exports of newly full blocks.
(The lookups' own timing -- batching, bounded waits, late answers -- is in
test_lookups.py; here the directory answers at once.)"""

import concurrent.futures
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.mechanism.host_holders import HELD_NOWHERE
from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.planning.directory_types import Location, QueryResult
from xinference.model.llm.vllm.xavier.planning.load_batch import DEST, KEY, RANK, SLOT
from xinference.model.llm.vllm.xavier.planning.load_cost import LoadCost, level_of
from xinference.model.llm.vllm.xavier.planning.lookups import DirectoryLookups
from xinference.model.llm.vllm.xavier.planning.scheduler_side import SchedulerSide

BS = 16


class World:
    """A real in-process directory where rank 1 holds some blocks; rank 2 asks."""

    def __init__(self, held_keys: Sequence[int], num_groups: int = 1,
                 cost: Optional[LoadCost] = None, decline: bool = False,
                 publish_loaded: bool = False) -> None:
        self.directory = BlockDirectory()
        self.directory.register_rank(1)
        self.directory.register_rank(2)
        self.directory.register(1, [(g, k, 1, 100 + i, 1) for g in range(num_groups)
                                    for i, k in enumerate(held_keys)])
        self.calls: List[int] = []
        self.lease_calls = 0
        self.answer_leases = True
        self.pending: List = []
        groups = list(range(num_groups))

        def send(batch):
            self.calls.append(len(batch))
            fut = concurrent.futures.Future()
            fut.set_result(self.directory.query_many(groups, [k for _, k in batch], 2, False))
            return fut

        self.side = SchedulerSide(2, BS, num_groups, DirectoryLookups(send), self.release,
                                  take_leases=self.take_leases, cost=cost, decline=decline,
                                  publish_loaded=publish_loaded)

    def take_leases(self, locations):
        self.lease_calls += 1
        fut = concurrent.futures.Future()
        locations = [Location(*row) for row in locations.tolist()]  # as the actor does
        if self.answer_leases:
            fut.set_result(self.directory.lease(2, locations))
        else:
            self.pending.append((fut, locations))
        return fut

    def grant_pending(self) -> None:
        for fut, locations in self.pending:
            fut.set_result(self.directory.lease(2, locations))
        self.pending = []

    def release(self, ids: Sequence[int]) -> None:
        self.directory.release(list(ids))

    @property
    def leases(self) -> int:
        return self.directory.outstanding_leases


def keys_of(n: int, base: int = 1000) -> List[int]:
    return [base + i for i in range(n)]


def test_match_queries_beyond_local_hit_and_never_the_last_token_block():
    w = World(held_keys=keys_of(8))
    w.side.track("r", lambda: keys_of(8), 128)
    # 8 full blocks, 128 tokens: the block holding token 127 is never offered; the lookup
    # asked from block 0, the local hit covers 2
    assert w.side.match("r", num_tokens=128, num_computed_tokens=32) == (7 - 2) * BS
    # asking again with the same local hit (vLLM could not allocate): the same answer
    assert w.side.match("r", num_tokens=128, num_computed_tokens=32) == 5 * BS
    assert w.calls == [1]
    # another local hit (preempted, cache evicted): the old hit goes, a new lookup is made
    assert w.side.match("r", num_tokens=129, num_computed_tokens=0) == 8 * BS
    assert w.calls == [1, 1]
    assert w.leases == 0  # a hit waiting for its blocks pins no source slot
    w.side.finished("r")
    assert w.leases == 0 and w.lease_calls == 0


def test_sharing_off_or_not_ready_is_a_miss_without_leases():
    w = World(held_keys=keys_of(4))
    w.side.track("off", lambda: keys_of(4), 100, sharing=False)
    w.side.track("on", lambda: keys_of(4), 100, ready=False)
    assert w.side.match("off", 100, 0) == 0
    assert w.side.match("on", 100, 0, ready=False) == 0
    assert w.leases == 0 and w.calls == []


def test_allocated_builds_rows_skips_null_blocks_and_releases_only_their_leases():
    w = World(held_keys=keys_of(6))
    w.side.track("r", lambda: keys_of(6), 200)
    assert w.side.match("r", 200, 0) == 6 * BS
    block_ids = [[0, 0, 7, 8, 9, 10, 11]]  # two leading null blocks (sliding window)
    null = [[True, True, False, False, False, False, False]]
    assert w.side.allocated("r", block_ids, null, 6 * BS) == 4
    meta = w.side.build_step([("r", 6 * BS, 10)], {})
    assert meta.loads.request_ids == ("r",)
    assert meta.loads.table[:, DEST].tolist() == [7, 8, 9, 10]
    assert meta.loads.table[:, KEY].tolist() == keys_of(6)[2:]
    assert set(meta.loads.table[:, RANK].tolist()) == {1}
    assert meta.loads.table[:, SLOT].tolist() == [102, 103, 104, 105]
    assert meta.stats.requests_with_hits == 1 and meta.stats.steps_with_loads == 1
    assert meta.stats.null_blocks_skipped == 2
    assert w.leases == 4  # nothing reads the null positions: released; the rest held
    assert w.side.loads_in_flight == 1 and w.side.held_leases == 4
    w.side.loads_finished(["r"])  # vLLM: every worker reported the load done
    assert w.leases == 0 and w.side.held_leases == 0 and w.side.loads_in_flight == 0


def test_a_request_is_offered_one_load_and_recomputes_after_it_failed():
    """vLLM asks again after a failed load (its source died, the directory does not know
    yet): the answer is 0, no lookup, no lease -- vLLM recomputes.  Control: before its
    hit was allocated, asking again gets the same hit."""
    w = World(held_keys=keys_of(6))
    w.side.track("r", lambda: keys_of(6), 200)
    assert w.side.match("r", 200, 0) == 6 * BS
    assert w.side.match("r", 200, 0) == 6 * BS  # not allocated yet: the same answer
    assert w.side.allocated("r", [list(range(1, 13))], [[False] * 12], 6 * BS) == 6
    meta = w.side.build_step([("r", 6 * BS, 10)], {})
    assert meta.loads.request_ids == ("r",) and w.calls == [1]
    w.side.loads_finished(["r"])  # the load failed: reported done, its blocks failed
    assert w.side.match("r", 200, 0) == 0
    assert w.leases == 0 and w.calls == [1]
    w.side.finished("r")


def test_a_failed_loads_wait_is_not_learned_as_a_hits_wait():
    """vLLM asks again after a failed load and recomputes: the request's time until its
    first forward (a dark peer's read ran into its 30 s timeout) is not a hit's wait, so the
    cost model does not learn it and the step does not count a hit started.  Control: a
    load that worked is learned."""
    for failed in (True, False):
        cost = measured_cost()
        w = World(held_keys=keys_of(100), cost=cost)
        now = [10.0]
        w.side._clock = lambda now=now: now[0]
        w.side.track("r", lambda: keys_of(200), 200 * BS)
        assert w.side.match("r", 200 * BS, 0) == 100 * BS
        key = cost.wait_key(0)
        w.side.allocated("r", [list(range(200))], [[False] * 200], 100 * BS)
        w.side.build_step([], {})
        now[0] += 31.0
        w.side.loads_finished(["r"])
        if failed:
            assert w.side.match("r", 200 * BS, 0) == 0  # vLLM asks again: recomputed
        started = w.side.build_step([("r", 0 if failed else 100 * BS, 8)], {}).stats
        assert started.hits_started == (0 if failed else 1)
        assert (max(cost.wait_samples_at(key)) < 1.0) == failed  # the 31 s learned or not
        w.side.finished("r")


def test_fewer_external_tokens_than_offered_leases_only_the_blocks_taken():
    w = World(held_keys=keys_of(6))
    w.side.track("r", lambda: keys_of(6), 200)
    w.side.match("r", 200, 0)
    w.side.allocated("r", [list(range(1, 13))], [[False] * 12], 2 * BS)
    w.side.allocated("s", [[1]], [[False]], 0)  # unknown request: nothing happens
    with pytest.raises(ValueError, match="num_external_tokens"):
        w.side.track("t", lambda: keys_of(6), 200)
        w.side.match("t", 200, 0)
        w.side.allocated("t", [list(range(1, 13))], [[False] * 12], BS + 3)
    meta = w.side.build_step([], {})
    assert meta.loads.num_rows == 2 and meta.stats.leases_asked == 2
    assert w.leases == 2  # only the blocks vLLM took are leased


def test_zero_external_tokens_loads_and_leases_nothing():
    w = World(held_keys=keys_of(3))
    w.side.track("r", lambda: keys_of(3), 200)
    assert w.side.match("r", 100, 0) == 3 * BS
    w.side.allocated("r", [[1, 2, 3, 4]], [[False] * 4], 0)
    assert not w.side.build_step([("r", 0, 64)], {}).has_loads
    assert w.lease_calls == 0 and w.leases == 0


def two_loads_allocated(publish_loaded: bool) -> World:
    """Requests "a" and "b" of 6 blocks + 5 tokens, each with a 4-block hit from rank 1,
    allocated (blocks 11-17 and 21-27)."""
    w = World(held_keys=keys_of(4, 1000) + keys_of(4, 2000), publish_loaded=publish_loaded)
    for rid, base in (("a", 1000), ("b", 2000)):
        w.side.track(rid, (lambda b=base: keys_of(6, b)), 6 * BS + 5)
        assert w.side.match(rid, 6 * BS + 5, 0) == 4 * BS
    w.side.allocated("a", [[11, 12, 13, 14, 15, 16, 17]], [[False] * 7], 4 * BS)
    w.side.allocated("b", [[21, 22, 23, 24, 25, 26, 27]], [[False] * 7], 4 * BS)
    return w


@pytest.mark.parametrize("publish_loaded", [False, True])
def test_one_step_carries_every_request_and_exports_newly_full_blocks(publish_loaded):
    """(A load launched in the step that computes its request is not published with it:
    its copies may not have run when the forward ends.)"""
    w = two_loads_allocated(publish_loaded)
    # the step computes the rest of the prompts: blocks 4 and 5 become full (block 6 does not)
    meta = w.side.build_step([("a", 4 * BS, 2 * BS + 5), ("b", 4 * BS, 2 * BS + 5)], {})
    assert meta.loads.request_ids == ("a", "b") and meta.loads.offsets.tolist() == [0, 4, 8]
    assert sorted(meta.exports) == sorted([(0, 1004, 15), (0, 1005, 16),
                                           (0, 2004, 25), (0, 2005, 26)])
    assert meta.stats.steps_with_loads == 1 and meta.stats.hit_blocks == 8
    # next step: decode of "a" appends a block; nothing becomes full yet, nothing to load
    meta2 = w.side.build_step([("a", 6 * BS + 5, 1)], {"a": ([[18]], False)})
    assert not meta2.has_loads and meta2.exports == ()
    assert meta2.stats.steps_with_loads == 0


@pytest.mark.parametrize("publish_loaded", [True, False])
def test_a_loaded_prefix_is_exported_with_the_first_step_that_computes_it(publish_loaded):
    """vLLM's cache read in place: the blocks a load wrote are published by the loader too
    (it holds them now), once vLLM knows the load done -- never in the step that launches
    it; blocks vLLM recomputes after a failed read are exported as computed."""
    w = two_loads_allocated(publish_loaded)
    launched = w.side.build_step([], {})  # the loads' step: neither request runs yet
    assert launched.loads.request_ids == ("a", "b") and launched.exports == ()
    # both loads done; b's third block failed its read: vLLM recomputes b from block 2
    meta = w.side.build_step([("a", 4 * BS, 2 * BS + 5), ("b", 2 * BS, 4 * BS + 5)], {})
    loaded = [(0, 1000 + i, 11 + i) for i in range(4)] + [(0, 2000 + i, 21 + i)
                                                           for i in range(2)]
    computed = [(0, 1004, 15), (0, 1005, 16)] + [(0, 2000 + i, 21 + i) for i in range(2, 6)]
    assert sorted(meta.exports) == sorted(computed + (loaded if publish_loaded else []))
    assert meta.stats.hits_started == 2
    # the next step publishes nothing again
    assert w.side.build_step([("a", 6 * BS + 5, 1)], {"a": ([[18]], False)}).exports == ()


def test_multi_group_hits_are_the_common_prefix_of_all_groups():
    w = World(held_keys=keys_of(5), num_groups=2)
    w.directory.unregister_rank(1)
    w.directory.register_rank(1)
    w.directory.register(1, [(0, k, 1, i, 1 + i) for i, k in enumerate(keys_of(5))], 55)
    w.directory.register(1, [(1, k, 1, 50 + i, 1) for i, k in enumerate(keys_of(3))], 66)
    w.side.track("r", lambda: keys_of(5), 200)
    assert w.side.match("r", 200, 0) == 3 * BS
    w.side.allocated("r", [[1, 2, 3, 4], [5, 6, 7, 8]], [[False] * 4, [False] * 4], 3 * BS)
    meta = w.side.build_step([("r", 3 * BS, 10)], {})
    assert w.leases == 6  # three per group
    rows: Dict[int, List[int]] = {}
    for g, _, _, _, _, dest, _, _ in meta.loads.table.tolist():
        rows.setdefault(g, []).append(dest)
    assert rows == {0: [1, 2, 3], 1: [5, 6, 7]}
    # each row names what the directory promised: the slot's generation, the storage
    assert meta.loads.table[:, 6:].tolist() == [[1, 55], [2, 55], [3, 55]] + [[1, 66]] * 3


def test_a_failing_directory_is_a_miss():
    def broken(batch):
        raise ConnectionError("directory gone")

    side = SchedulerSide(2, BS, 1, DirectoryLookups(broken), lambda ids: None)
    side.track("r", lambda: keys_of(4), 100)
    assert side.match("r", 100, 0) == 0
    assert side.held_leases == 0


def test_new_requests_of_one_moment_share_one_lookup_call_and_the_step_counts_it():
    w = World(held_keys=keys_of(4, 1000) + keys_of(4, 2000) + keys_of(4, 3000))
    for rid, base in (("a", 1000), ("b", 2000), ("c", 3000)):
        w.side.track(rid, (lambda b=base: keys_of(4, b)), 100)
    assert [w.side.match(rid, 100, 0) for rid in "abc"] == [4 * BS] * 3
    assert w.calls == [3]  # the first match sent all three lookups in one call
    meta = w.side.build_step([], {})
    assert meta.stats.lookup_calls == 1 and meta.stats.queries == 3


def test_an_answer_that_covers_only_local_blocks_asks_again_from_the_local_hit():
    """The peer holds blocks 2..5 of a prefix whose blocks 0..1 this replica has: the
    lookup asked from block 0 finds nothing; a second one from block 2 finds the rest."""
    w = World(held_keys=[])
    w.directory.register(1, [(0, k, 1, 50 + k, 1) for k in keys_of(6)[2:]])
    w.side.track("r", lambda: keys_of(6), 200)
    assert w.side.match("r", 200, num_computed_tokens=2 * BS) == 4 * BS
    assert w.calls == [1, 1]


def test_step_meta_table_is_int64_and_validates():
    w = World(held_keys=keys_of(2))
    w.side.track("r", lambda: keys_of(3), 200)
    w.side.match("r", 40, 0)
    w.side.allocated("r", [[5, 6, 7]], [[False] * 3], 2 * BS)
    meta = w.side.build_step([("r", 2 * BS, 8)], {})
    assert meta.loads.table.dtype == np.int64
    assert meta.loads.num_rows == 2


def test_per_request_split_keeps_each_requests_rows():
    w = World(held_keys=keys_of(3, 1000) + keys_of(2, 2000))
    w.side.track("a", lambda: keys_of(4, 1000), 200)
    w.side.track("b", lambda: keys_of(3, 2000), 200)
    w.side.match("a", 100, 0)
    w.side.match("b", 100, 0)
    w.side.allocated("a", [[1, 2, 3, 4]], [[False] * 4], 3 * BS)
    w.side.allocated("b", [[5, 6, 7]], [[False] * 3], 2 * BS)
    meta = w.side.build_step([("a", 3 * BS, 5), ("b", 2 * BS, 5)], {})
    parts = meta.per_request()
    assert [p.request_ids for p in parts] == [("a",), ("b",)]
    assert [p.table[:, DEST].tolist() for p in parts] == [[1, 2, 3], [5, 6]]
    # after rows were dropped (an unreachable peer), each request keeps its own rows
    fewer = meta.loads.without_rows(meta.loads.table[:, DEST] == 2)
    assert [p.table[:, DEST].tolist() for p in meta.per_request(fewer)] == [[1, 3], [5, 6]]
    with pytest.raises(ValueError, match="^loads: not the step's requests"):
        meta.per_request(meta.loads.split()[0])


def test_loads_that_are_not_a_valid_batch_become_failed_destinations(monkeypatch):
    """A defect the scheduler side cannot be made to produce with real inputs (a fake makes
    the batch invalid): the step carries the requests with no rows, their destinations as
    failed (the worker reports them: vLLM recomputes); nothing is read, so nothing is
    leased; counted."""
    from xinference.model.llm.vllm.xavier.planning import step_loads
    from xinference.model.llm.vllm.xavier.planning.load_batch import LoadBatchError

    w = World(held_keys=keys_of(3, 1000))
    w.side.track("a", lambda: keys_of(4, 1000), 200)
    w.side.match("a", 100, 0)
    w.side.allocated("a", [[1, 2, 3, 4]], [[False] * 4], 3 * BS)

    def invalid(request_ids, tables):
        raise LoadBatchError("dest: made invalid by the test")

    monkeypatch.setattr(step_loads.LoadBatch, "from_tables", invalid)
    meta = w.side.build_step([("a", 3 * BS, 5)], {})
    assert meta.loads.request_ids == ("a",) and meta.loads.num_rows == 0
    assert meta.failed_dests == (1, 2, 3)
    assert meta.stats.rejected_metadata == 1 and meta.stats.leases_asked == 0
    assert w.leases == 0 and w.lease_calls == 0
    w.side.loads_finished(["a"])  # the worker reports the (failed) load: nothing to do
    assert w.leases == 0


def test_names_with_equal_low_bits_never_share_a_step():
    """The load table carries a block name's low 63 bits: two requests whose blocks have
    different names with equal low bits would be read from one source by the planner.  The
    later request's loads are dropped (its destinations failed: vLLM recomputes them),
    counted; the first keeps its loads (#23).  Control: equal names in two requests are
    one block read for both (nothing dropped)."""
    short = 1 << 63
    names = keys_of(3)
    forged = [names[0], names[1] + 5 * short, names[2]]  # block 1: same low bits, other name
    w = World(held_keys=names + forged[1:2])
    w.side.track("a", lambda: names, 3 * BS + 1)
    w.side.track("b", lambda: forged, 3 * BS + 1)
    w.side.track("c", lambda: names, 3 * BS + 1)
    for rid, dests in (("a", [10, 11, 12]), ("b", [20, 21, 22]), ("c", [30, 31, 32])):
        assert w.side.match(rid, 3 * BS + 1, 0) == 3 * BS
        assert w.side.allocated(rid, [dests], [[False] * 3], 3 * BS) == 3
    step = w.side.build_step([], {})
    assert step.stats.identity_clashes == 1
    assert step.loads.request_ids == ("a", "b", "c")
    assert step.loads.rows_of("b").shape[0] == 0 and sorted(step.failed_dests) == [20, 21, 22]
    assert step.loads.rows_of("a")[:, DEST].tolist() == [10, 11, 12]
    assert step.loads.rows_of("c")[:, DEST].tolist() == [30, 31, 32]  # the control
    assert all(0 <= k < short for k in step.loads.table[:, KEY].tolist())
    # the dropped request reads nothing, so it leases nothing; a and c hold their reads
    assert step.stats.leases_asked == 6 and w.leases == 6
    w.side.loads_finished(["a", "b", "c"])  # the dropped request's (failed) load too
    assert w.leases == 0


def test_a_request_that_reads_no_prefix_cache_is_never_offered_a_load_but_exports():
    """vLLM skips its prefix cache for some requests (``skip_reading_prefix_cache``: e.g.
    prompt logprobs need every prompt token computed); Xavier must not load for them
    either, but their computed blocks are still exported (#23)."""
    w = World(held_keys=keys_of(4))
    w.side.track("r", lambda: keys_of(4), 4 * BS + 1, loads=False)
    assert w.side.match("r", 4 * BS + 1, 0) == 0
    assert w.calls == [] and w.leases == 0
    w.side.allocated("r", [[5, 6, 7, 8, 9]], [[False] * 5], 0)
    step = w.side.build_step([("r", 0, 4 * BS + 1)], {})
    assert [k for _, k, _ in step.exports] == keys_of(4) and not step.has_loads
    w.side.track("control", lambda: keys_of(4), 4 * BS + 1)
    assert w.side.match("control", 4 * BS + 1, 0) == 4 * BS
    w.side.finished("control")
    assert w.leases == 0


def test_a_hits_time_to_its_first_forward_is_split_into_lookup_and_load_wait():
    """A hit's time before its first forward, on the side's clock: arrival to the answer
    (``hit_lookup_us``), allocation to the step that first computes it
    (``hit_load_wait_us``: vLLM's asynchronous load path); counted once per hit, in the
    step that starts it; a miss counts nothing."""
    w = World(held_keys=keys_of(8))
    now = [10.0]
    w.side._clock = lambda: now[0]
    w.side.track("r", lambda: keys_of(8), 8 * BS)
    w.side.track("m", lambda: keys_of(8, base=5000), 8 * BS)  # a miss
    now[0] += 0.003
    assert w.side.match("r", 8 * BS, 0) == 7 * BS
    assert w.side.match("m", 8 * BS, 0) == 0
    now[0] += 0.001
    assert w.side.allocated("r", [list(range(10, 18))], [[False] * 8], 7 * BS) == 7
    assert w.side.build_step([], {}).stats.hits_started == 0  # the load's step: not started
    now[0] += 0.005
    stats = w.side.build_step([("r", 7 * BS, BS), ("m", 0, 8 * BS)], {}).stats
    assert (stats.hits_started, stats.hit_lookup_us, stats.hit_load_wait_us) == (1, 3000, 5000)
    assert w.side.build_step([("r", 8 * BS, 1)], {}).stats.hits_started == 0  # once


def test_leases_are_taken_with_the_step_and_released_when_vllm_reports_the_load_done():
    """A request's reads are leased by the step that carries its load (one directory call
    per step), not when it arrives: a request waiting in vLLM's queue pins nothing.  The
    one place a load's leases go: vLLM's ``finished_recving`` (every worker done, copies
    complete).  An abort while the load is in flight (vLLM calls ``request_finished`` at
    once, keeps the blocks and reports the load when it ends) keeps them: releasing then
    would let the source reuse a slot under the copy."""
    w = World(held_keys=keys_of(4, 1000) + keys_of(4, 2000))
    w.side.track("a", lambda: keys_of(5, 1000), 5 * BS + 1)
    w.side.track("b", lambda: keys_of(5, 2000), 5 * BS + 1)
    assert w.side.match("a", 5 * BS + 1, 0) == 4 * BS
    assert w.side.match("b", 5 * BS + 1, 0) == 4 * BS
    assert w.leases == 0  # answered, waiting: nothing pinned
    w.side.allocated("a", [[1, 2, 3, 4, 5, 6]], [[False] * 6], 4 * BS)
    assert w.leases == 0 and w.lease_calls == 0
    w.side.build_step([], {})
    assert w.leases == 4 and w.lease_calls == 1
    w.side.finished("a")  # aborted while its load is in flight
    w.side.finished("b")  # never allocated
    assert w.leases == 4 and w.side.loads_in_flight == 1
    w.side.loads_finished(["b", "unknown"])  # not loads of this side: nothing happens
    assert w.leases == 4
    w.side.loads_finished(["a"])
    assert w.leases == 0
    w.side.loads_finished(["a"])  # reported twice (a second TP aggregation): harmless
    assert w.leases == 0


def load_sent_leases_unanswered() -> World:
    """A world whose request "r" loads 4 blocks, sent in a step whose lease call the
    directory has not answered yet (``grant_pending`` answers it)."""
    w = World(held_keys=keys_of(4))
    w.answer_leases = False
    w.side.track("r", lambda: keys_of(5), 5 * BS + 1)
    assert w.side.match("r", 5 * BS + 1, 0) == 4 * BS
    w.side.allocated("r", [[1, 2, 3, 4, 5]], [[False] * 5], 4 * BS)
    w.side.build_step([], {})
    return w


def test_a_load_reported_done_before_its_leases_were_granted_releases_them_on_arrival():
    """The lease call is not waited for: when vLLM reports the load done first (a fast
    copy, a slow directory), the leases are released as soon as they are granted; a
    lease call that failed leaves nothing to release (the reads were checked anyway)."""
    w = load_sent_leases_unanswered()
    w.side.loads_finished(["r"])
    assert w.leases == 0 and w.side.held_leases == 0
    w.grant_pending()  # granted now, released at once
    assert w.leases == 0
    failed = concurrent.futures.Future()
    failed.set_exception(ConnectionError("directory gone"))
    w.side.leases._release_slice(0, 4, failed)  # nothing granted: nothing released, no error


def test_close_releases_every_lease_still_held():
    """Engine shutdown: no load report will come; the loads in flight give their leases
    back (the rest holds none)."""
    w = World(held_keys=keys_of(4, 1000) + keys_of(4, 2000) + keys_of(4, 3000)
              + keys_of(4, 4000))
    for rid, base in (("flight", 1000), ("building", 2000), ("hit", 3000), ("asked", 4000)):
        w.side.track(rid, (lambda b=base: keys_of(5, b)), 5 * BS + 1)
    for rid in ("flight", "building", "hit"):
        assert w.side.match(rid, 5 * BS + 1, 0) == 4 * BS
    w.side.allocated("flight", [[1, 2, 3, 4, 5]], [[False] * 5], 4 * BS)
    w.side.build_step([], {})
    w.side.allocated("building", [[6, 7, 8, 9, 10]], [[False] * 5], 4 * BS)
    w.side.lookups.flush()  # "asked": answered, never taken
    assert w.leases == 4 and w.side.held_leases == 4
    assert w.side.close() == []  # no lease call left unanswered
    assert w.leases == 0 and w.side.held_leases == 0
    w.side.close()  # idempotent
    assert w.leases == 0


def test_close_hands_back_the_lease_calls_still_unanswered_and_releases_them_on_arrival():
    """At shutdown a step's lease call may still be on its way: ``close`` returns it (the
    connector waits for it, bounded, before its last flush), and the leases it grants are
    released as they arrive."""
    w = load_sent_leases_unanswered()
    pending = w.side.close()
    assert len(pending) == 1 and not pending[0].done()
    w.grant_pending()
    assert pending[0].done() and w.leases == 0


def measured_cost(wait_s: float = 0.008, per_token: float = 8e-6) -> LoadCost:
    """A cost model that has seen steps of a prefill time ``per_token`` and one hit wait
    ``wait_s`` with nothing else running: a lone hit pays from ``wait_s / per_token``
    tokens on (1000 with the defaults)."""
    cost = LoadCost(lag=0)
    now = 0.0
    for i in range(64):
        tokens = (1, 512, 8, 2048)[i % 4]
        cost.step(now, tokens)
        now += 0.004 + per_token * tokens
    for _ in range(2):  # (known from the second sample on)
        cost.hit_waited(wait_s, cost.wait_key(0))
    return cost


def test_a_hit_that_would_wait_longer_than_its_recompute_is_declined_and_counted():
    """``xavier_load_policy`` cost: a request whose candidate blocks could all pay is looked
    up; its hit of 8 blocks (128 tokens: 8 ms of wait against 1 ms of prefill) is declined:
    vLLM computes it, it is not offered a load again, no load leaves; a hit of 100 blocks
    (1600 tokens) is loaded."""
    w = World(held_keys=keys_of(8) + keys_of(100, base=9000), cost=measured_cost(),
              decline=True)
    w.side.track("short", lambda: keys_of(200), 200 * BS)
    w.side.track("long", lambda: keys_of(200, base=9000), 200 * BS)
    assert w.side.match("short", 200 * BS, 0) == 0
    assert w.side.match("short", 200 * BS, 0) == 0  # asked again: no new lookup
    assert w.side.match("long", 200 * BS, 0) == 100 * BS
    assert w.calls == [2]
    w.side.allocated("short", [list(range(200))], [[False] * 200], 0)
    w.side.allocated("long", [list(range(200, 400))], [[False] * 200], 100 * BS)
    step = w.side.build_step([], {})
    assert step.loads.request_ids == ("long",)
    stats = step.stats
    assert (stats.hits_not_paying, stats.hits_declined, stats.hit_tokens_declined) == (1, 1, 128)


def test_a_request_none_of_whose_blocks_could_pay_is_not_even_looked_up():
    """Until a run of such skips reaches ``explore_every``: that request is looked up (and
    its hit loaded), so the level's wait is measured again."""
    w = World(held_keys=keys_of(8), cost=measured_cost(), decline=True)
    w.side.cost.explore_every = 3
    for i in range(3):  # each has at most 7 blocks to load: 112 tokens
        w.side.track(f"r{i}", lambda: keys_of(8), 8 * BS)
    assert [w.side.match(f"r{i}", 8 * BS, 0) for i in range(3)] == [0, 0, 7 * BS]
    stats = w.side.build_step([], {}).stats
    assert w.calls == [1] and stats.lookups_skipped_not_paying == 2
    assert stats.queries == 1 and stats.hits_declined == 0


def test_loading_every_hit_still_counts_those_that_do_not_pay():
    """``xavier_load_policy`` always: the same short hit is loaded, and counted as one that
    did not pay (what a user reads before switching to cost)."""
    w = World(held_keys=keys_of(8), cost=measured_cost(), decline=False)
    w.side.track("r", lambda: keys_of(8), 8 * BS)
    assert w.side.match("r", 8 * BS, 0) == 7 * BS
    w.side.allocated("r", [list(range(8))], [[False] * 8], 7 * BS)
    stats = w.side.build_step([], {}).stats
    assert (stats.hits_not_paying, stats.hits_declined, stats.requests_with_hits) == (1, 0, 1)


def test_the_model_is_fed_by_the_steps_and_each_hits_wait_at_its_key():
    """The side's steps feed the fit (their scheduled tokens, on its clock) and a hit's
    allocation-to-first-forward wait at its key (load level and the step in flight at its
    allocation: "busy" ran beside it, its latest step of 101 tokens in flight; the quieter
    steps it then waited through leave the key as it was); the estimates go out with the
    step's figures; the last request's end marks the engine idle."""
    cost = LoadCost(lag=0, min_steps=4, min_token_spread=1)
    w = World(held_keys=keys_of(8), cost=cost)
    now = [0.0]
    w.side._clock = lambda: now[0]
    w.side.track("busy", lambda: keys_of(4, base=7000), 4 * BS)
    for i in range(8):  # steps of 1 and 101 tokens taking 1 ms + 10 µs a token
        tokens = 1 + 100 * (i % 2)
        w.side.build_step([("busy", 0, tokens)], {})
        now[0] += 0.001 + 1e-5 * tokens
    fixed, per_token = cost.step_line()
    assert (fixed, per_token) == (pytest.approx(0.001), pytest.approx(1e-5))
    w.side.track("r", lambda: keys_of(8), 8 * BS)
    assert w.side.match("r", 8 * BS, 0) == 7 * BS
    w.side.allocated("r", [list(range(8))], [[False] * 8], 7 * BS)  # "busy" runs beside it
    for _ in range(3):  # the load's step and two more before the hit's first forward
        w.side.build_step([("busy", 0, 1)], {})
        now[0] += 0.00101
    stats = w.side.build_step([("r", 7 * BS, BS), ("busy", 0, 1)], {}).stats
    assert cost.wait_samples_at((1, 2)) == [pytest.approx(0.00303)]
    assert cost.expected_wait_s(0) is None
    assert stats.cost_prefill_ns_per_token == 10_000 and stats.cost_step_fixed_us == 1000
    assert stats.cost_hit_wait_us == 3030  # at the load level of the hit's allocation
    w.side.finished("r")
    w.side.finished("busy")
    samples = cost.fit.samples
    now[0] += 1.5
    w.side.build_step([("next", 0, 1)], {})
    assert cost.fit.samples == samples  # the idle 1.5 s is no step (only the idle mark says)


@pytest.mark.parametrize("recomputes", [False, True])
def test_a_bursts_hits_are_kept_under_the_load_they_waited_through_not_an_idle_engines(
        recomputes):
    """H100, session 37: a burst on an idle engine (a steady-state fill) had 16 hits of 512
    blocks allocated one by one in one long schedule, all beside nothing running (key
    ``(0, 0)``), waiting 88-151 ms through steps that scheduled nothing else; kept at
    ``(0, 0)`` those waits declined the lone C1 hits that followed (which waited 11-28 ms
    loaded): 12 of 16 follow-ups recomputed their 8K prefix.  A wait is kept under the
    busiest step it waited through, counting the hits waiting beside it (and, with
    ``recomputes``, the burst's misses prefilling beside them), so a lone request on the
    idle engine finds no wait at its key and loads.  At allocation each hit's key already
    counts the hits allocated before it in the schedule (nothing runs: the first is
    ``(0, 0)``, as a lone request's)."""
    cost = measured_cost(wait_s=0.0)
    cost._wait_s.clear()  # steps measured (prefill 8 µs a token), no hit's wait yet
    w = World(held_keys=keys_of(100), cost=cost, decline=True)
    now = [100.0]
    w.side._clock = lambda: now[0]
    w.side.finished("nobody")  # the engine is idle: nothing in flight
    burst = [f"b{i}" for i in range(4)]
    for i, rid in enumerate(burst):
        w.side.track(rid, lambda: keys_of(101), 101 * BS)
        assert w.side.match(rid, 101 * BS, 0) == 100 * BS
        w.side.allocated(rid, [list(range(101))], [[False] * 101], 100 * BS)
        assert w.side._tracked[rid].wait_key == (level_of(i), 0)  # beside the hits before
    misses = [(f"m{i}", 0, 2048) for i in range(4)] if recomputes else []
    for _ in range(2):  # the load's step and the one already scheduled
        w.side.build_step(misses, {})
        now[0] += 0.05
    w.side.loads_finished(burst)
    w.side.build_step([(rid, 100 * BS, 16) for rid in burst], {})
    # 3 hits beside each (level 2); with the misses 7 requests and 8K tokens a step
    assert cost.wait_samples_at((3, 7) if recomputes else (2, 0)) == [pytest.approx(0.1)] * 4
    assert cost.wait_samples_at((0, 0)) == []
    for rid in burst + [m for m, _, _ in misses]:
        w.side.finished(rid)
    w.side.track("lone", lambda: keys_of(101), 101 * BS)  # 1600 tokens: ~13 ms to recompute
    assert cost.wait_key(0) == (0, 0) and cost.expected_wait_s(0) is None
    assert w.side.match("lone", 101 * BS, 0) == 100 * BS  # loaded, not declined


class HostWorld(World):
    """:class:`World` where rank 3, a peer of this host, holds the first ``on_host`` of
    the keys in vLLM's cache (what its host index answers); the directory holds what
    ``held_keys`` names (rank 1, Xavier's GPU tier)."""

    def __init__(self, held_keys: Sequence[int], on_host: Sequence[int]) -> None:
        super().__init__(held_keys)
        self.on_host = list(on_host)
        self.probes = 0
        self.side._on_host = self.find

    evicted_next = False  # the block after the host's part was held there once
    nowhere = False  # no index of the launch names a first block the peer does not hold

    def find(self, keys):
        self.probes += 1
        n = 0
        while n < len(keys) and n < len(self.on_host) and keys[n] == self.on_host[n]:
            n += 1
        if not n:
            return (HELD_NOWHERE, False) if self.nowhere else None
        rows = [(3, 2, 0, 500 + i, 7, 99) for i in range(n)]  # rank 3, Tier.VLLM
        return QueryResult(tuple(keys[:n]), rows, (0,) * n), self.evicted_next


def test_a_hit_a_same_host_peer_holds_is_answered_without_a_lookup():
    w = HostWorld(held_keys=[], on_host=keys_of(8))
    w.side.track("r", lambda: keys_of(8), 128)
    assert w.side.match("r", num_tokens=128, num_computed_tokens=0) == 7 * BS
    assert w.side.allocated("r", [list(range(10, 18))], [[False] * 8], 7 * BS) == 7
    meta = w.side.build_step([("r", 0, 16)], {})
    assert w.calls == [] and meta.stats.lookup_calls == 0 and meta.stats.queries == 0
    assert meta.stats.host_index_hits == 1 and meta.stats.host_index_blocks == 7
    assert meta.loads.table[:, RANK].tolist() == [3] * 7
    assert meta.loads.table[:, SLOT].tolist() == list(range(500, 507))
    assert w.lease_calls == 0  # vLLM's cache read in place: nothing to lease


def test_the_directory_is_asked_only_for_the_blocks_after_the_host_hit():
    """The peer of this host holds 3 blocks, rank 1 (Xavier's tier, say) holds the next
    4: the directory is asked for those at arrival and its answer, there by the time vLLM
    asks, extends the hit; one that is not there yet is not waited for."""
    keys = keys_of(8)
    w = HostWorld(held_keys=keys[3:7], on_host=keys[:3])
    w.side.track("r", lambda: keys, 128)
    w.side.lookups.flush()
    assert w.calls == [1]
    assert w.side.match("r", num_tokens=128, num_computed_tokens=0) == 7 * BS
    w.side.allocated("r", [list(range(10, 18))], [[False] * 8], 7 * BS)
    meta = w.side.build_step([("r", 0, 16)], {})
    assert meta.loads.table[:, RANK].tolist() == [3] * 3 + [1] * 4
    assert meta.stats.host_index_blocks == 3 and meta.stats.queried_blocks == 4
    # the same, the directory slow: nobody of this host ever held block 3 (only another
    # host could): the host's blocks alone, at once
    pending = []
    w.side.lookups._send = lambda batch: pending.append(batch) or concurrent.futures.Future()
    w.side.track("s", lambda: keys, 128)
    w.side.lookups.flush()
    assert w.side.match("s", num_tokens=128, num_computed_tokens=0) == 3 * BS
    assert len(pending) == 1 and w.side.lookups.outstanding == 0  # (its late answer: dropped)
    # block 3 was held on this host once (vLLM handed it out: Xavier's tiers may hold it):
    # the answer is waited for (within the step's budget, then asked again next step)
    w.evicted_next = True
    w.side.lookups._wait_budget_s = 0.0
    w.side.track("t", lambda: keys, 128)
    assert w.side.match("t", num_tokens=128, num_computed_tokens=0) is None
    assert w.side.lookups.outstanding == 1


def test_a_host_hit_gone_by_the_time_vllm_asks_still_gets_the_directorys_hit():
    """The host held the first 3 blocks when the request arrived (the directory was asked
    for the rest), none when vLLM asks (its entries moved on): the directory is asked
    again from the request's first block, and its hit is the request's."""
    keys = keys_of(8)
    w = HostWorld(held_keys=keys[:7], on_host=keys[:3])
    w.side.track("r", lambda: keys, 128)
    w.on_host = []
    assert w.side.match("r", num_tokens=128, num_computed_tokens=0) == 7 * BS
    meta = w.side.build_step([], {})
    assert meta.stats.host_index_hits == 0 and w.calls == [1, 1]


def test_a_request_no_rank_of_the_launch_holds_is_a_miss_without_a_lookup():
    """The host's indexes are the whole launch's and none names the first block: no
    lookup is sent at arrival, vLLM's ask is answered 0 at once (not None: no step waits),
    counted; the next test is the control (the same request, the directory asked)."""
    w = HostWorld(held_keys=[], on_host=[])
    w.nowhere = True
    w.side.lookups._wait_budget_s = 0.0
    w.side.track("r", lambda: keys_of(8), 128)
    w.side.lookups.flush()
    assert w.side.match("r", num_tokens=128, num_computed_tokens=0) == 0
    meta = w.side.build_step([("r", 0, 128)], {})
    assert w.calls == [] and meta.stats.lookup_calls == 0
    assert meta.stats.lookups_skipped_held_nowhere == 1 and meta.stats.queries == 0
    w.nowhere = False  # (the control: the same request is asked, and waits for it)
    w.side.track("s", lambda: keys_of(8), 128)
    w.side.lookups._send = lambda batch: concurrent.futures.Future()
    assert w.side.match("s", num_tokens=128, num_computed_tokens=0) is None


def test_a_directory_answer_already_there_is_kept_though_no_index_names_the_block():
    """The lookup went out at arrival (the host's indexes were not yet the whole launch's)
    and its answer is there when vLLM asks: it is used, though no index names the first
    block now (one whose entry a full bucket reused: held in a tier, say)."""
    w = HostWorld(held_keys=keys_of(8), on_host=[])
    w.side.track("r", lambda: keys_of(8), 128)
    w.side.lookups.flush()
    w.nowhere = True
    assert w.side.match("r", num_tokens=128, num_computed_tokens=0) == 7 * BS
    meta = w.side.build_step([], {})
    assert meta.stats.lookups_skipped_held_nowhere == 0 and meta.stats.queries == 1


def test_a_request_no_peer_of_the_host_holds_goes_to_the_directory():
    w = HostWorld(held_keys=keys_of(8), on_host=[])
    w.side.track("r", lambda: keys_of(8), 128)
    assert w.side.match("r", num_tokens=128, num_computed_tokens=0) == 7 * BS
    meta = w.side.build_step([], {})
    assert meta.stats.host_index_hits == 0 and meta.stats.queries == 1
