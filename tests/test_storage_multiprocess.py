"""Storage, directory and loads across real processes: the tracker, the exporting rank
and the loading rank each live in their own xoscar sub pool (spawned processes)."""

import asyncio

import pytest

from .support.pools import nixl_available
from .support.reliability import record
from .support.replica_actors import storage_world

pytestmark = pytest.mark.slow


def test_export_query_load_across_processes_with_eviction_and_overflow():
    async def run():
        pool_cm, tracker, a, b = await storage_world(gpu_blocks=2, cpu_blocks=4)
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
            await a.close()
            await b.close()
        finally:
            await pool_cm.__aexit__(None, None, None)

    asyncio.run(run())


@pytest.mark.parametrize("scheme", [
    "", pytest.param("nixl", marks=pytest.mark.skipif(
        not nixl_available(), reason="NIXL not installed (scripts/setup.sh installs it)"))],
    ids=["sockets", "nixl"])
def test_remote_storage_through_xoscar_copy_to(scheme):
    """The cross-host path: rank 2 does not map rank 1's memory; blocks travel through
    xoscar copy_to: plain sockets, or NIXL (UCX over loopback here) with nixl:// pools."""

    async def run():
        pool_cm, tracker, a, b = await storage_world(gpu_blocks=2, cpu_blocks=4, remote=True,
                                             scheme=scheme)
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
            assert (await tracker.stats())["outstanding_leases"] == 0
            await a.close()
            await b.close()
        finally:
            await pool_cm.__aexit__(None, None, None)

    asyncio.run(run())
