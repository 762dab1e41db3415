"""Two GPUs of one host (the lent ``nvidia-h200-x2``): loads that cross GPUs.

Every rank is its own xoscar sub pool (a spawned process), as replicas are under
Xinference.  Two placements:

* ``isolated``: each sub pool gets ``CUDA_VISIBLE_DEVICES`` of one GPU, as Xinference
  gives each replica; every process sees its GPU as ``cuda:0``, so a peer's CUDA IPC
  handle names a device index that means another GPU here (the driver maps it by peer
  access);
* ``shared``: every process sees both GPUs and picks ``cuda:1`` / ``cuda:0`` itself.

Source rank 1's storage is on the other GPU than the loader's cache, rank 3's on the same
one; one load call takes blocks of both ranks and both tiers.  Each test first checks, by
GPU uuid and PCI location, that the ranks really are on different GPUs, and that the
destination blocks differ from the expected bytes before the load (a skipped copy fails).

The NIXL test forces the cross-host path between the two GPUs' processes: the loader
does not map rank 1's memory; blocks travel through xoscar ``copy_to`` on ``nixl://``
pools (or plain sockets, for comparison).

Skipped unless two CUDA devices are present (CI has none; ``doc/gpu.md`` says how to
run them).
"""

import asyncio
from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker

from .support.pools import actor_pool, gpu_envs, nixl_available, sub_pool_addresses
from .support.replica_actors import LoaderRankActor, StorageRankActor

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

#: per placement: the sub pools' GPUs (tracker, rank 1, rank 3, loader rank 2) and the
#: device each rank puts its tensors on
PLACEMENTS = {
    "isolated": (["-", "1", "0", "0"], {1: "cuda", 3: "cuda", 2: "cuda"}),
    "shared": (None, {1: "cuda:1", 3: "cuda:0", 2: "cuda:0"}),
}
BLOCK_BYTES = 3 * 2 * 16 * 8 * 2  # LAYERS x BLOCK x bf16 (support.replica_actors)


async def _world(gpus: Optional[Sequence[str]], devices: Dict[int, str], sources: List[int],
                 gpu_blocks: int, cpu_blocks: int, scheme: str = "") -> Any:
    n = 2 + len(sources)
    pool_cm = actor_pool(n_process=n, scheme=scheme, envs=gpu_envs(gpus, n))
    pool = await pool_cm.__aenter__()
    addrs = sub_pool_addresses(pool)
    uid = f"{VLLMBlockTracker.default_uid()}-model"
    tracker = await xo.create_actor(VLLMBlockTracker, address=addrs[0], uid=uid)
    storages = {}
    for i, rank in enumerate(sources):
        storages[rank] = await xo.create_actor(
            StorageRankActor, rank, addrs[0], uid, gpu_blocks, cpu_blocks, 7 + rank,
            devices[rank], address=addrs[1 + i], uid=f"rank-{rank}")
    loader = await xo.create_actor(LoaderRankActor, 2, addrs[0], uid, devices[2],
                                   address=addrs[-1], uid="rank-2")
    return pool_cm, tracker, storages, loader, addrs


async def _assert_on_other_gpu(source: Any, loader: Any) -> None:
    src, dst = await source.cuda_device(), await loader.cuda_device()
    assert src["uuid"] and dst["uuid"]
    assert src["uuid"] != dst["uuid"] and src["pci"] != dst["pci"], (src, dst)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_cuda_ipc_loads_across_gpus_from_two_source_ranks(placement):
    gpus, devices = PLACEMENTS[placement]

    async def run():
        pool_cm, tracker, st, loader, _ = await _world(gpus, devices, [1, 3], gpu_blocks=4,
                                                       cpu_blocks=8)
        try:
            await _assert_on_other_gpu(st[1], loader)
            assert (await st[3].cuda_device())["uuid"] == (await loader.cuda_device())["uuid"]
            # rank 1: 6 blocks through a 4-block GPU tier (room made ahead demotes 2 to its
            # CPU tier: a device-to-host copy on the writer's stream); rank 3: 3
            await st[1].export([(0, 100 + i, 10 + i) for i in range(3)])
            assert await st[1].make_room(3) == 2
            r = await st[1].export([(0, 103 + i, 13 + i) for i in range(3)])
            assert r["exported"] == 3
            await st[3].export([(0, 200 + i, 20 + i) for i in range(3)])
            for rank in (1, 3):
                await loader.map_peer(rank, await st[rank].handles())

            keys = [100 + i for i in range(6)] + [200 + i for i in range(3)]
            q = await loader.query(keys)
            assert q.num_hits == 9
            where = sorted({(loc.rank, int(loc.tier)) for loc in q.locations})
            assert where == [(1, 0), (1, 1), (3, 0)]
            dests = list(range(30, 39))
            expected = (await st[1].block_digests([10 + i for i in range(6)])
                        + await st[3].block_digests([20 + i for i in range(3)]))
            assert all(a != b for a, b in zip(await loader.block_digests(dests), expected))

            out = await loader.load(q, dests)
            assert out["error"] is None and out["written"] == 9
            assert out["digests"] == expected  # bf16 bit patterns, NaNs included
            c = await loader.counters()
            assert c["batch_calls"] == 1 and c["transfers"] == 3  # one per (rank, tier)
            assert c["blocks_written"] == 9 and c["useful_bytes"] == 9 * BLOCK_BYTES
            assert (await tracker.stats())["outstanding_leases"] == 0
            for s in st.values():
                await s.close()
            await loader.close()
        finally:
            await pool_cm.__aexit__(None, None, None)

    asyncio.run(run())


@pytest.mark.parametrize("scheme", [
    "", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(),
                                                      reason="NIXL not installed"))],
    ids=["sockets", "nixl"])
def test_remote_storage_between_two_gpus_through_xoscar_copy_to(scheme):
    """Rank 1 on GPU 1, the loader on GPU 0, neither maps the other's memory."""
    gpus, devices = PLACEMENTS["isolated"]

    async def run():
        pool_cm, tracker, st, loader, addrs = await _world(
            [gpus[0], gpus[1], gpus[3]], devices, [1], gpu_blocks=2, cpu_blocks=4,
            scheme=scheme)
        try:
            await _assert_on_other_gpu(st[1], loader)
            await st[1].export([(0, 100, 10), (0, 101, 11)])
            await st[1].make_room(2)
            await st[1].export([(0, 102, 12), (0, 103, 13)])
            await st[1].make_room(1)
            await st[1].export([(0, 104, 14)])  # GPU tier (CUDA memory): 103, 104; CPU: 100-102
            await loader.map_remote_peer(1, addrs[1], "rank-1", await st[1].storage_layouts())
            q = await loader.query([100, 101, 102, 103, 104])
            assert q.num_hits == 5
            assert sorted({int(loc.tier) for loc in q.locations}) == [0, 1]
            dests = [40, 41, 42, 43, 44]
            expected = await st[1].block_digests([10, 11, 12, 13, 14])
            assert all(a != b for a, b in zip(await loader.block_digests(dests), expected))

            out = await loader.load(q, dests)
            assert out["error"] is None and out["written"] == 5
            assert out["digests"] == expected
            c = await loader.counters()
            assert c["transfers"] == 2 and c["batch_calls"] == 1  # one copy_to per tier
            assert c["useful_bytes"] == 5 * BLOCK_BYTES
            assert (await tracker.stats())["outstanding_leases"] == 0
            await st[1].close()
            await loader.close()
        finally:
            await pool_cm.__aexit__(None, None, None)

    asyncio.run(run())
