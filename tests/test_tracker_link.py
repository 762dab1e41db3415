"""The worker's link to the directory actor, over a real xoscar pool in another process:
what it sends :class:`Packed` (a registration's rows, a demotion's, claimed slots) and what
a scheduler sends so (forgotten blocks; a load's locations as an array) reaches the
directory as the same rows a plain list would.  What packing saves:
``benchmarks/directory_call_bench.py``."""

import time

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.planning.directory_types import Packed, unpacked
from xinference.model.llm.vllm.xavier.planning.load_batch import NO_LEASE, Tier
from xinference.model.llm.vllm.xavier.vllm_side.actor_bridge import ActorBridge, LazyActor
from xinference.model.llm.vllm.xavier.vllm_side.tracker_link import TrackerLink

from .support.host_indexes import names
from .support.pools import actor_served

GPU, VLLM = int(Tier.GPU), int(Tier.VLLM)


@pytest.fixture(scope="module")
def tracker_address():
    """A directory actor in a sub pool: every call from this process crosses processes
    (serialized, as an engine's calls to the supervisor are)."""
    with actor_served(VLLMBlockTracker, "tracker", in_sub_pool=True) as address:
        yield address


def test_packed_rows_reach_the_directory_as_the_rows_themselves(tracker_address):
    bridge = ActorBridge.shared()
    tracker = LazyActor(bridge, tracker_address, "tracker", checked=False)
    ref = tracker.get()
    link = TrackerLink(bridge, tracker)
    bridge.call(lambda: ref.register_rank(1, 1))
    keys = names(512)  # 192-bit block names
    # rows as a writer makes them, numpy ints among them (coerced before they are sent)
    rows = [(0, k, GPU, np.int64(s), s + 1) for s, k in enumerate(keys)]
    assert link.register(1, rows, 7) == 512
    [hit] = bridge.call(lambda: ref.query_many([0], Packed([keys]), None, False))
    assert hit.keys == tuple(keys)
    assert hit.table.tolist() == [[1, GPU, 0, s, s + 1, 7] for s in range(512)]
    assert (hit.lease_table == NO_LEASE).all()
    # a load's locations as an array (one buffer): leased, then released
    leases = bridge.call(lambda: ref.lease(2, hit.table[:4]))
    assert len(leases) == 4 and NO_LEASE not in leases
    assert bridge.call(lambda: ref.stats())["outstanding_leases"] == 4
    assert bridge.call(lambda: ref.release(list(leases))) == 4
    assert bridge.call(lambda: ref.stats())["outstanding_leases"] == 0
    # a demotion (rows and the slots it frees, packed): the lower copies registered, the
    # upper slots claimed -- their entries gone
    moved = [(0, keys[0], int(Tier.CPU), 40, 1), (0, keys[1], int(Tier.CPU), 41, 1)]
    link.move(1, moved, GPU, 0, [0, 1], 7)
    [hit] = bridge.call(lambda: ref.query_many([0], Packed([keys[:2]]), None, False))
    assert hit.table[:, 1].tolist() == [int(Tier.CPU)] * 2
    assert hit.table[:, 3].tolist() == [40, 41]
    assert sorted(link.claim(1, GPU, 0, [2, 3])) == [2, 3]
    [hit] = bridge.call(lambda: ref.query_many([0], Packed([keys[2:4]]), None, False))
    assert hit.num_hits == 0
    # forgotten blocks of vLLM's cache, packed as the scheduler sends them
    link.register(1, [(0, k, VLLM, 100 + i, 1) for i, k in enumerate(keys[4:8])], 7)
    forgotten = Packed({0: [(100, 2), (101, 2)]})
    assert bridge.call(lambda: ref.forget(1, VLLM, forgotten)) == 2
    [hit] = bridge.call(lambda: ref.query_many([0], Packed([keys[4:8]]), None, False))
    assert hit.num_hits == 0  # (its first block went: no prefix left)


def test_unpacked_takes_a_packed_value_or_the_argument_itself():
    assert unpacked(Packed([1, 2])) == [1, 2]
    assert unpacked([1, 2]) == [1, 2] and unpacked(None) is None


def test_a_writer_link_announces_its_host_index_before_any_publication(tracker_address):
    """As the engine registered: until its index is announced, every same-host peer counts
    its rank as one of another host (and registers its whole vLLM cache in the directory
    again).  Control: before the link is made, the directory lists no index of the rank."""
    from xinference.model.llm.vllm.xavier.planning.routes import host_id
    from xinference.model.llm.vllm.xavier.planning.shards import Shards
    from xinference.model.llm.vllm.xavier.vllm_side.tracker_link import writer_link

    from .support.host_indexes import Engine

    bridge = ActorBridge.shared()
    tracker = LazyActor(bridge, tracker_address, "tracker", checked=False)
    ref = tracker.get()
    bridge.call(lambda: ref.register_rank(4, 1))
    engine = Engine(rank=4)
    try:
        def listed():
            return [p for r, _, p in bridge.call(lambda: ref.host_indexes(host_id())) if r == 4]

        assert listed() == []
        writer_link(bridge, tracker, 4, Shards(num_groups=1, tp_size=1), 0, engine.index)
        deadline = time.monotonic() + 10
        while listed() != [engine.index.path]:  # (sent without waiting)
            assert time.monotonic() < deadline, "the index was never announced"
            time.sleep(0.05)
    finally:
        engine.close()
