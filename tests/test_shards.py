"""Tensor-parallel shards in the planning layer (no vLLM): directory groups per TP worker,
a block loadable only when every shard of it is stored, each worker's rows and leases,
the writer's link translating its groups."""

import concurrent.futures
from typing import List, Sequence

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory, ShardLink
from xinference.model.llm.vllm.xavier.planning.directory_types import Location
from xinference.model.llm.vllm.xavier.planning.load_batch import DEST, GROUP, RANK, SLOT
from xinference.model.llm.vllm.xavier.planning.lookups import DirectoryLookups
from xinference.model.llm.vllm.xavier.planning.scheduler_side import SchedulerSide
from xinference.model.llm.vllm.xavier.planning.shards import Shards

BS = 16
KEYS = [1000 + i for i in range(6)]


def test_directory_groups_are_group_major_and_tp_one_is_unchanged():
    two = Shards(num_groups=2, tp_size=2)
    assert [two.directory_group(g, k) for g in range(2) for k in range(2)] == [0, 1, 2, 3]
    assert two.directory_groups == [0, 1, 2, 3]
    assert [(two.kv_group(d), two.tp_rank(d)) for d in range(4)] == [(0, 0), (0, 1), (1, 0),
                                                                       (1, 1)]
    one = Shards(num_groups=3)
    assert one.directory_groups == [0, 1, 2] and one.directory_group(2, 0) == 2
    with pytest.raises(ValueError, match="^tp_rank: 2 outside tensor_parallel_size 2"):
        two.directory_group(0, 2)
    with pytest.raises(ValueError, match="^tensor_parallel_size"):
        Shards(1, 0)


class TPWorld:
    """Rank 1 (a TP=2 replica) stores shards through each worker's :class:`ShardLink`;
    rank 2 (TP=2 as well) looks up and plans its loads."""

    def __init__(self) -> None:
        self.directory = BlockDirectory()
        self.directory.register_rank(1)
        self.directory.register_rank(2)
        self.shards = Shards(num_groups=1, tp_size=2)
        self.links = [ShardLink(LocalDirectory(self.directory), self.shards, k)
                      for k in range(2)]

        def send(batch):
            fut = concurrent.futures.Future()
            fut.set_result(self.directory.query_many(self.shards.directory_groups,
                                                     [k for _, k in batch], 2, False))
            return fut

        def take_leases(locations):
            fut = concurrent.futures.Future()
            # rows of Location fields, as the tracker actor receives them
            fut.set_result(self.directory.lease(2, [Location(*r) for r in locations.tolist()]))
            return fut

        self.side = SchedulerSide(2, BS, 1, DirectoryLookups(send), self.release,
                                  take_leases=take_leases, tp_size=2)

    def store(self, tp_rank: int, keys: Sequence[int], slot0: int) -> None:
        """Worker ``tp_rank`` of rank 1 publishes ``keys`` in its GPU tier (group 0)."""
        self.links[tp_rank].register(1, [(0, k, 0, slot0 + i, 1) for i, k in enumerate(keys)])

    def release(self, ids: Sequence[int]) -> None:
        self.directory.release(list(ids))


def test_a_block_is_a_hit_only_when_every_shard_of_it_is_stored():
    w = TPWorld()
    w.store(0, KEYS, slot0=10)
    w.side.track("r", lambda: KEYS, 6 * BS + 1)
    assert w.side.match("r", 6 * BS + 1, 0) == 0  # shard 1 not published: a miss
    assert w.directory.outstanding_leases == 0
    w.store(1, KEYS[:4], slot0=50)  # shard 1 of the first four only
    w.side.track("r2", lambda: KEYS, 6 * BS + 1)
    assert w.side.match("r2", 6 * BS + 1, 0) == 4 * BS
    w.side.allocated("r2", [[1, 2, 3, 4, 5, 6, 7]], [[False] * 7], 4 * BS)
    w.side.build_step([], {})
    assert w.directory.outstanding_leases == 8  # 4 blocks x 2 shards, one lease each
    w.side.finished("r2")  # e.g. aborted: its load is still in flight
    assert w.directory.outstanding_leases == 8
    w.side.loads_finished(["r2"])
    assert w.directory.outstanding_leases == 0


def test_each_worker_loads_its_shard_rows_and_releases_exactly_its_leases():
    w = TPWorld()
    w.store(0, KEYS, slot0=10)
    w.store(1, KEYS, slot0=50)
    w.side.track("r", lambda: KEYS, 6 * BS + 1)
    assert w.side.match("r", 6 * BS + 1, 0) == 6 * BS
    dests = [7, 8, 9, 11, 12, 13]
    assert w.side.allocated("r", [dests], [[False] * 6], 6 * BS) == 12  # 6 rows per shard
    step = w.side.build_step([], {})
    assert step.stats.hit_blocks == 6
    parts = [step.for_shard(k, 2) for k in range(2)]
    for k, part in enumerate(parts):
        table = part.loads.table
        assert part.loads.request_ids == ("r",)
        assert table[:, GROUP].tolist() == [0] * 6  # the worker's own KV-cache group
        assert table[:, DEST].tolist() == dests  # every shard writes the same blocks
        assert table[:, SLOT].tolist() == list(range(10 if k == 0 else 50, 6 + (
            10 if k == 0 else 50)))  # read from shard k's slots of rank 1
        assert set(table[:, RANK].tolist()) == {1}
        assert [p.num_rows for p in part.per_request()] == [6]
    # a lease per shard of each block, held by the scheduler half (one for the replica)
    # until vLLM's aggregation says every worker finished the load
    assert w.directory.outstanding_leases == 12 and w.side.held_leases == 12
    w.side.loads_finished(["r"])
    assert w.directory.outstanding_leases == 0
    assert step.for_shard(0, 1) is step  # without tensor parallelism: the step itself


def test_null_blocks_are_skipped_on_every_shard_and_counted_once():
    w = TPWorld()
    w.store(0, KEYS, slot0=10)
    w.store(1, KEYS, slot0=50)
    w.side.track("r", lambda: KEYS, 6 * BS + 1)
    assert w.side.match("r", 6 * BS + 1, 0) == 6 * BS
    null = [True, True, False, False, False, False]
    assert w.side.allocated("r", [[0, 0, 3, 4, 5, 6]], [null], 6 * BS) == 8
    step = w.side.build_step([], {})
    assert step.stats.null_blocks_skipped == 2
    assert w.side.held_leases == 8  # the skipped positions' leases (2 per shard) released
    for k in range(2):
        assert step.for_shard(k, 2).loads.table[:, DEST].tolist() == [3, 4, 5, 6]


def test_shard_link_names_directory_groups_in_register_claim_and_move():
    directory = BlockDirectory()
    shards = Shards(num_groups=2, tp_size=2)
    link = ShardLink(LocalDirectory(directory), shards, tp_rank=1)
    assert link.register(1, [(1, 77, 0, 5, 1)]) == 1
    hit = directory.query(3, [77])
    assert hit.num_hits == 1  # group 1 of worker 1 -> directory group 3
    assert directory.query(1, [77]).num_hits == 0
    directory.release(hit.lease_ids)
    assert link.move(1, [(1, 77, 1, 9, 1)], 0, 1, [5]) == [5]  # demoted: CPU slot 9
    hit = directory.query(3, [77])
    loc = hit.locations[0]
    assert (loc.tier, loc.group, loc.slot) == (1, 3, 9)
    directory.release(hit.lease_ids)
    assert link.claim(1, 1, 1, [9]) == [9]
    assert directory.query(3, [77]).num_hits == 0
    with pytest.raises(ValueError, match="^tp_rank"):
        ShardLink(LocalDirectory(directory), shards, tp_rank=2)


def test_for_shard_keeps_requests_without_rows_of_that_shard():
    from xinference.model.llm.vllm.xavier.planning.load_batch import BlockLoad, LoadBatch

    batch = LoadBatch.from_requests([
        ("a", [BlockLoad(0, 1, 1, 0, 3, 9), BlockLoad(1, 1, 1, 0, 4, 9)]),
        ("b", [BlockLoad(1, 2, 1, 0, 5, 10)])])
    zero = batch.for_shard(0, 2)
    assert zero.request_ids == ("a", "b") and zero.offsets.tolist() == [0, 1, 1]
    one = batch.for_shard(1, 2)
    assert one.offsets.tolist() == [0, 1, 2]
    assert one.table[:, GROUP].tolist() == [0, 0] and one.table[:, SLOT].tolist() == [4, 5]
    rows: List[int] = np.concatenate([zero.table[:, SLOT], one.table[:, SLOT]]).tolist()
    assert sorted(rows) == [3, 4, 5]
