"""Xinference 3.5.0's Xavier call sequence, replayed with real xoscar pools and real vLLM CPU
engines: supervisor actors, rank 0, two replicas, transfer start, rank registration,
shared-prefix traffic with cross-replica hits, the death and recovery of one replica, and
termination with nothing left behind.  (The order and arguments are those of
``core/supervisor.py``, ``core/worker.py`` and ``core/model.py`` of the 3.5.0 wheel, see
../shared/notes/xinference-3.5.0-contract.md.)"""

import asyncio

import pytest
import xoscar as xo

from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.collective_manager import (
    CollectiveManager,
    Rank0ModelActor,
)
from xinference.model.llm.vllm.xavier.transfer import TransferActor

from .support.engines import EngineOptions, cpu_engine_env
from .support.pools import actor_pool, sub_pool_addresses
from .support.processes import engine_cores, tokens
from .support.xavier_replicas import ReplicaActor

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODEL_UID = "qwen-tiny"


def xavier_config(tracker, rank, address, world_size):
    # what the supervisor and the worker put in it before VLLMModel.load
    return {"block_tracker_uid": tracker.uid, "block_tracker_address": tracker.address,
            "rank": rank, "world_size": world_size, "rank_address": address,
            "store_address": "127.0.0.1", "store_port": 0, "transfer_block_num": 512,
            "role": "hybrid", "vllm_transfer_backend_type": None,
            "xavier_cpu_budget": "64MiB", "xavier_gpu_budget": 0}


def test_launch_serve_recover_terminate(tiny_model_dir):
    async def run():
        kwargs = EngineOptions(model=tiny_model_dir).llm_kwargs()
        env = cpu_engine_env()
        async with actor_pool(n_process=3) as pool:
            sup = pool.external_address
            rank0_addr, r1_addr, r2_addr = sub_pool_addresses(pool)
            # supervisor: block tracker, then collective manager (no ctor args / model_uid)
            tracker = await xo.create_actor(
                VLLMBlockTracker, address=sup, uid=f"{VLLMBlockTracker.default_uid()}-{MODEL_UID}")
            cm = await xo.create_actor(
                CollectiveManager, address=sup, model_uid=MODEL_UID,
                uid=f"{CollectiveManager.default_uid()}-{MODEL_UID}")
            # worker: rank 0 first and alone
            rank0 = await xo.create_actor(
                Rank0ModelActor, address=rank0_addr, uid=f"{MODEL_UID}-rank0",
                xavier_config=xavier_config(tracker, 0, rank0_addr, 3))
            # ranks 1..2 in parallel: model actors whose load() builds XavierEngine
            addrs = {1: r1_addr, 2: r2_addr}

            def launch(rank):
                return xo.create_actor(
                    ReplicaActor, address=addrs[rank], uid=f"{MODEL_UID}-{rank - 1}",
                    rank=rank, opts=kwargs, xavier_config=xavier_config(tracker, rank,
                                                                       addrs[rank], 3), env=env)

            replicas = dict(zip((1, 2), await asyncio.gather(launch(1), launch(2))))
            world = [rank0_addr, r1_addr, r2_addr]
            # all ranks up: start_transfer_for_vllm gathered, then register_rank 0..N in order
            await asyncio.gather(rank0.start_transfer_for_vllm(world),
                                 *(r.start_transfer(world) for r in replicas.values()))
            for rank, addr in enumerate(world):
                await cm.register_rank(rank, addr, update=False)
            assert await cm.world() == world

            # shared-prefix traffic: A computes, B hits
            shared = tokens(1, 512)
            await replicas[1].generate([shared + tokens(2, 40)])
            out = await replicas[2].generate([shared + tokens(3, 40)])
            assert out[0]["cached"] == 512
            assert (await replicas[2].counters())["blocks_written"] == 32

            # replica 2 dies; Xinference's recover_model: unregister_rank, relaunch with the same
            # xavier_config, start_transfer_for_vllm([]), register_rank(update=True)
            await xo.destroy_actor(replicas[2])
            await cm.unregister_rank(2)
            stats = await tracker.stats()
            assert stats["outstanding_leases"] == 0
            assert await cm.world() == [rank0_addr, r1_addr]
            replicas[2] = await launch(2)
            await replicas[2].start_transfer([])
            await cm.register_rank(2, r2_addr, update=True)
            assert await cm.world() == world
            # the new rank 2 reads rank 1 (it got the world), rank 1 reads the new rank 2
            shared2 = tokens(11, 512)
            await replicas[1].generate([shared2 + tokens(12, 40)])
            out = await replicas[2].generate([shared2 + tokens(13, 40)])
            assert out[0]["cached"] == 512
            shared3 = tokens(21, 512)
            await replicas[2].generate([shared3 + tokens(22, 40)])
            out = await replicas[1].generate([shared3 + tokens(23, 40)])
            assert out[0]["cached"] == 512
            # each replica announced its host index as it registered, before it served
            # anything (the relaunched one too): from its first request on, replica 1 saw the
            # whole launch on this host, and every block it published stayed in its host
            # index -- none registered in the directory, none registered there again when
            # the recovered replica joined (xavier_local_publish)
            kept = await replicas[1].counters()
            assert kept["host_index_whole_launch"] == 1
            assert kept["in_place_kept_local"] == kept["in_place_registered"] > 0
            assert kept.get("in_place_republished", 0) == 0
            assert (await tracker.stats())["outstanding_leases"] == 0

            # terminate.  A model actor first stops its model (vLLM's shutdown, in a thread):
            # the worker's connector shutdown has the transfer actor let go of the engine's KV
            # caches before the engine process frees them.  Blocks it published in place (its
            # own vLLM cache, the default) leave the directory with it: the peer's request is
            # a miss, never a read of freed memory (Xavier's tiers, which hold nothing here,
            # would still serve until the actor goes).  A release naming another worker (an
            # engine since replaced) changes nothing.
            shared4 = tokens(31, 512)
            await replicas[1].generate([shared4 + tokens(32, 40)])
            assert not await replicas[1].release_engine_as(owner=1)
            assert await replicas[1].transfer_ready()
            await replicas[1].stop_engine()
            assert not await replicas[1].transfer_ready()
            written = (await replicas[2].counters())["blocks_written"]
            out = await replicas[2].generate([shared4 + tokens(33, 40)])
            assert out[0]["cached"] == 0
            assert (await replicas[2].counters())["blocks_written"] == written
            assert (await tracker.stats())["outstanding_leases"] == 0
            # then the model actors go (their transfer actors with them), rank 0, manager,
            # tracker
            for r in replicas.values():
                await xo.destroy_actor(r)
            await rank0.stop()
            await xo.destroy_actor(rank0)
            await xo.destroy_actor(cm)
            assert (await tracker.stats())["blocks"] == 0  # every rank took its blocks along
            await xo.destroy_actor(tracker)
            gone = [(r1_addr, f"{TransferActor.default_uid()}-1"),
                    (r2_addr, f"{TransferActor.default_uid()}-2"),
                    (rank0_addr, f"{TransferActor.default_uid()}-0"), (sup, tracker.uid),
                    (sup, cm.uid), (rank0_addr, rank0.uid)]
            for addr, uid in gone:
                assert not await xo.has_actor(xo.create_actor_ref(addr, uid)), uid
            for _ in range(60):
                if not engine_cores():
                    break
                await asyncio.sleep(0.5)
            assert engine_cores() == []
            # (a storage budget that holds no KV block fails the launch naming the option:
            # test_xinference_local.py's CLI launch, through Xinference's own rollback)

    asyncio.run(run())

