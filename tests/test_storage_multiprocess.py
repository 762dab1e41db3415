"""Storage, directory and loads across real processes: the tracker, the exporting rank
and the loading rank each live in their own xoscar sub pool (spawned processes).  The
tests on sockets share one pool (each with actors of its own); NIXL's needs ``nixl://``
pools of its own.

The last three are the ways issue #33 names to serve wrong KV through bookkeeping alone,
each run with the reads checked (every row failed, vLLM recomputes) and, as the negative
control, unchecked (the loader gets another block's bytes under the asked names)."""

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, List, Tuple

import pytest
import xoscar as xo

from .support.loop_thread import LoopThread, enter, leave
from .support.pools import actor_pool, nixl_available, sub_pool_addresses
from .support.reliability import record
from .support.replica_actors import (
    LoaderRankActor,
    StorageRankActor,
    destroy,
    storage_actors,
    storage_world,
    tracker_uid,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pools() -> Iterator[Tuple[LoopThread, List[str]]]:
    """Three sub pools (tracker, exporting rank, loading rank) for every sockets test of
    the module, on a loop of their own."""
    loop = LoopThread()
    cm = actor_pool(n_process=3)
    pool = loop.run(enter(cm))
    try:
        yield loop, sub_pool_addresses(pool)
    finally:
        loop.run(leave(cm))
        loop.stop()


def test_export_query_load_across_processes_with_eviction_and_overflow(pools):
    loop, subs = pools

    async def run():
        tracker, a, b = await storage_actors(subs, gpu_blocks=2, cpu_blocks=4, tag="-evict")
        try:
            # rank 1 fills its 2-slot GPU tier; room made ahead demotes the LRU block
            await a.export([(0, 100, 10), (0, 101, 11)])
            assert await a.make_room(1) == 1
            r = await a.export([(0, 102, 12)])
            assert r["exported"] == 1 and r["skipped_no_slot"] == 0
            assert [await a.where(k) for k in (100, 101, 102)][0][0] == 1  # 100: CPU tier
            q = await b.query([100, 101, 102, 555])
            assert q.keys == (100, 101, 102)
            out = await b.load(q, [40, 41, 42])
            assert out["error"] is None and out["written"] == 3
            assert sorted(out["tiers"]) == [0, 0, 1]
            assert out["digests"] == await a.block_digests([10, 11, 12])
            assert (await tracker.stats())["outstanding_leases"] == 0

            # a peer holds leases on both GPU-tier blocks while rank 1 needs room
            held = await b.query([101, 102])
            assert await a.make_room(2) == 0  # demoted, but the leased slots are refused
            r = await a.export([(0, 104, 14)])
            assert r["exported"] == 0 and r["skipped_no_slot"] == 1  # never waits, skips
            out = await b.load(held, [50, 51])
            assert out["error"] is None
            assert out["digests"] == await a.block_digests([11, 12])  # bytes intact
            assert await a.make_room(2) == 2  # released: now they go (copies in CPU tier)
            r = await a.export([(0, 104, 14)])
            assert r["exported"] == 1

            # rank 1 goes away between query and load: a miss / a refused load
            q = await b.query([104])
            assert q.num_hits == 1
            assert await tracker.unregister_rank(1) > 0
            assert (await b.query([100, 101])).keys == ()
            await b.unmap_peer(1)
            out = await b.load(q, [60])
            assert out["written"] == 0 and "rank" in out["error"]
            stats = await tracker.stats()
            assert stats["outstanding_leases"] == 0 and stats["blocks"] == 0
            record("tier budgets exhausted under leases (3 processes)", 2, 2, 3, 0,
                   "2 leased GPU slots refused for reuse, the export skipped, not waited")
        finally:
            await destroy(tracker, a, b)

    loop.run(run())


@pytest.mark.parametrize("scheme", [
    "", pytest.param("nixl", marks=pytest.mark.skipif(
        not nixl_available(), reason="NIXL not installed (scripts/setup.sh installs it)"))],
    ids=["sockets", "nixl"])
def test_remote_storage_through_xoscar_copy_to(scheme, request):
    """The cross-host path: rank 2 does not map rank 1's memory; blocks travel through
    xoscar copy_to: plain sockets, or NIXL (UCX over loopback here) with nixl:// pools."""

    async def run():
        if scheme:
            pool_cm, tracker, a, b = await storage_world(gpu_blocks=2, cpu_blocks=4,
                                                         remote=True, scheme=scheme)
        else:
            pool_cm, (tracker, a, b) = None, await storage_actors(
                subs, gpu_blocks=2, cpu_blocks=4, remote=True, tag="-remote")
        try:
            await a.export([(0, 100, 10), (0, 101, 11)])
            await a.make_room(2)
            await a.export([(0, 102, 12), (0, 103, 13)])
            await a.make_room(1)
            await a.export([(0, 104, 14)])  # GPU tier: 103, 104; CPU tier: 100-102
            q = await b.query([100, 101, 102, 103, 104])
            assert q.num_hits == 5 and sorted(set(q.locations[i].tier for i in range(5))) == [0, 1]
            out = await b.load(q, [40, 41, 42, 43, 44])
            assert out["error"] is None and out["written"] == 5
            assert out["digests"] == await a.block_digests([10, 11, 12, 13, 14])
            c = await b.counters()
            assert c["transfers"] == 2 and c["batch_calls"] == 1  # one per tier
            assert c["useful_bytes"] == 5 * 3 * 2 * 16 * 8 * 2  # 5 blocks x 3 layers, bf16
            # checked against what the source said its slots held after its gather
            assert (c["reads_validated"], c["validation_failures"]) == (5, 0)
            assert (await tracker.stats())["outstanding_leases"] == 0
        finally:
            if pool_cm is None:
                await destroy(tracker, a, b)
            else:
                await a.close()
                await b.close()
                await pool_cm.__aexit__(None, None, None)

    if scheme:
        asyncio.run(run())
    else:
        loop, subs = request.getfixturevalue("pools")  # the shared pools: sockets only
        loop.run(run())


# ------------------------------------------------ bookkeeping slips: a miss, never wrong KV
@dataclass
class Slip:
    """A scenario's actors: the tracker, rank 1 (``a``; ``fresh`` once restarted), the
    loader whose reads are checked (``b``) and one whose reads are not (``c``: the negative
    control), both mapping rank 1 as peers of this host."""

    subs: List[str]
    tag: str
    tracker: Any
    a: Any
    b: Any
    c: Any
    fresh: Any = None

    async def load_both(self, answer: Any, dests: List[int]) -> Tuple[dict, dict]:
        """``answer`` loaded by the checked and by the unchecked loader (the same rows)."""
        return await self.b.load(answer, dests), await self.c.load(answer, dests)

    async def restart(self, seed: int) -> Any:
        """Rank 1 recovered under the same rank with a fresh storage (a new incarnation
        whose slots start again at generation 1): the old one unregistered and closed (its
        files unlinked; the loaders' mappings of them stay), the new one in its sub pool."""
        await self.tracker.unregister_rank(1)
        await self.a.close()
        self.fresh = await xo.create_actor(
            StorageRankActor, 1, self.subs[0], tracker_uid(self.tag), 2, 4, seed,
            address=self.subs[1], uid=f"rank-1{self.tag}-restarted")
        return self.fresh


@contextlib.asynccontextmanager
async def slip(subs: List[str], tag: str) -> AsyncIterator[Slip]:
    tracker, a, b = await storage_actors(subs, 2, 4, tag=tag)
    c = await xo.create_actor(LoaderRankActor, 3, subs[0], tracker_uid(tag), "cpu", False,
                              address=subs[2], uid=f"rank-3{tag}-unchecked")
    await c.map_peer(1, await a.handles(), await a.generations_handle())
    w = Slip(subs, tag, tracker, a, b, c)
    try:
        yield w
    finally:
        await destroy(tracker, *(r for r in (w.fresh, a, b, c) if r is not None))


def test_a_held_answer_outlives_its_source_s_restart_and_every_read_fails(pools):
    """Scenario 1: a lookup is answered (the request waits in vLLM's queue, its leases
    held), rank 1 restarts with a fresh storage that exports other prompts into the same
    slot numbers at the same generations, the loader maps the new storage (the world
    update worked), then the held answer is loaded.  Checked: every row fails (the
    incarnation differs).  Unchecked: the new prompts' bytes under the old names."""
    loop, subs = pools

    async def run():
        async with slip(subs, "-restart") as w:
            await w.a.export([(0, 100, 10), (0, 101, 11)])
            held = await w.b.query([100, 101])
            assert held.num_hits == 2
            fresh = await w.restart(seed=8)
            await fresh.export([(0, 200, 20), (0, 201, 21)])
            new = await w.b.query([200, 201])
            assert [(x.slot, x.generation) for x in new.locations] == [
                (x.slot, x.generation) for x in held.locations]  # only the storage differs
            for loader in (w.b, w.c):
                await loader.unmap_peer(1)
                await loader.map_peer(1, await fresh.handles(), await fresh.generations_handle())
            checked, unchecked = await w.load_both(held, [40, 41])
            assert checked["failed"] == [40, 41] and checked["written"] == 0
            wrong = await fresh.block_digests([20, 21])
            assert unchecked["failed"] == [] and unchecked["digests"] == wrong  # wrong KV
            counts = await w.b.counters()
            assert (counts["validation_failures"], counts["reads_validated"]) == (2, 2)
            assert await w.b.stale_ranks() == []  # the rows were old, not the mapping
            record("held answer outlives its source's restart (3 processes)", 2, 2, 2, 0,
                   "checked: both rows failed (other incarnation); unchecked: new bytes")
            assert (await w.b.load(new, [42, 43]))["failed"] == []  # the new rows load

    loop.run(run())


def test_a_mapping_that_missed_the_world_update_fails_every_read_and_is_named_stale(pools):
    """Scenario 2: rank 1 restarts with a fresh storage, but the loader's world update
    is missed (its mapping of the dead storage stays: the old bytes, still mapped); the
    new storage publishes other prompts in the same slots and the loader loads them
    through the old mapping.  Checked: every row fails and the mapping is handed out as
    stale (mapped again).  Unchecked: the dead storage's bytes under the new names."""
    loop, subs = pools

    async def run():
        async with slip(subs, "-missed") as w:
            await w.a.export([(0, 100, 10), (0, 101, 11)])
            old = await w.a.block_digests([10, 11])
            fresh = await w.restart(seed=9)
            await fresh.export([(0, 200, 20), (0, 201, 21)])
            checked, unchecked = await w.load_both(await w.b.query([200, 201]), [40, 41])
            assert checked["failed"] == [40, 41] and checked["written"] == 0
            assert unchecked["failed"] == [] and unchecked["digests"] == old  # wrong KV
            assert await w.b.stale_ranks() == [1] and await w.c.stale_ranks() == []
            record("a mapping that missed the world update (3 processes)", 2, 2, 2, 0,
                   "checked: both rows failed, the mapping named stale; unchecked: old bytes")

    loop.run(run())


def test_a_slot_reused_under_a_lease_the_directory_forgot_fails_its_read(pools):
    """Scenario 3: a reader's leases are gone from the directory (a re-created directory
    knows none; a late release freed them), so the source claims the slots, demotes their
    blocks and exports others into them; the reader then loads its answer.  Checked: the
    reused slots' rows fail (their generations moved).  Unchecked: the other prompts'
    bytes."""
    loop, subs = pools

    async def run():
        async with slip(subs, "-forgot") as w:
            tracker, a = w.tracker, w.a
            await a.export([(0, 100, 10), (0, 101, 11)])
            held = await w.b.query([100, 101])
            assert await tracker.release(list(held.lease_ids)) == 2  # forgotten
            assert await a.make_room(2) == 2  # demoted to the CPU tier, GPU slots claimed
            await a.export([(0, 102, 12), (0, 103, 13)])  # into the same GPU slots
            checked, unchecked = await w.load_both(held, [40, 41])
            assert checked["failed"] == [40, 41]
            assert unchecked["failed"] == []
            wrong = await a.block_digests([12, 13])
            assert sorted(unchecked["digests"]) == sorted(wrong)  # wrong KV
            stats = await tracker.stats()
            assert stats["unknown_releases"] == 4  # both loads' releases find no lease
            assert stats["outstanding_leases"] == 0
            record("a slot reused under a forgotten lease (3 processes)", 2, 2, 2, 0,
                   "checked: both rows failed (generations moved); unchecked: other bytes")

    loop.run(run())
