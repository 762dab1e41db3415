"""The TransferActor's own parts: storage tiers from the options, the engine's release, how
peers on other hosts are read."""

import asyncio

import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.mechanism.rank_shard import RankShard
from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (
    SnapshotStorage,
    TierConfig,
    tier_configs,
)
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier
from xinference.model.llm.vllm.xavier.transfer import EngineNotRegisteredError, TransferActor

from .kvfixtures import engine_cache, opts


def test_tier_configs_from_options():
    layout = layout_of({0: [torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)]})
    block = layout.groups[0].block_bytes  # 4 KiB
    cpu_only = tier_configs(opts(xavier_gpu_budget=0, xavier_cpu_budget="64KiB"),
                                           layout, torch.device("cpu"))
    assert [(t.tier, t.budget_bytes, t.shared_memory) for t in cpu_only] == [
        (Tier.CPU, 64 * 1024, True)]
    # no GPU: both budgets make one shared-memory tier
    both = tier_configs(opts(xavier_gpu_budget="8KiB", xavier_cpu_budget="8KiB"),
                                       layout, torch.device("cpu"))
    assert [t.budget_bytes for t in both] == [16 * 1024]
    with pytest.raises(ValueError, match=r"xavier_cpu_budget: 1024 .* smaller than one KV block "
                                         rf"\({block} bytes\)"):
        tier_configs(opts(xavier_gpu_budget=0, xavier_cpu_budget="1KiB"),
                                    layout, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the .* bytes available"):
        tier_configs(opts(xavier_gpu_budget=0, xavier_cpu_budget="1000TiB"),
                                    layout, torch.device("cpu"))


def test_release_engine_names_its_owner_and_keeps_the_storage():
    """The worker's connector shutdown releases the engine: only the registering worker's
    pid does; afterwards the rank is not ready (no hits offered), and the storage still
    serves peers until the actor goes."""
    _, layout, bb = engine_cache(8)

    async def run():
        actor = TransferActor(1, 2, "a", "127.0.0.1", 0, [])
        storage = SnapshotStorage(1, layout, [TierConfig(Tier.CPU, 8 * bb, shared_memory=True)])
        actor._shards = {0: RankShard(storage, None, 7, None)}
        assert not await actor.release_engine(8)  # another worker's late shutdown
        assert actor.is_ready()
        assert await actor.release_engine(7)
        assert not actor.is_ready()
        kept = actor.storage_descriptor()["tiers"]
        await actor._close_runtime()
        return kept

    kept = asyncio.run(run())
    assert list(kept) == [int(Tier.CPU)] and kept[int(Tier.CPU)][0] == "shm"


def test_a_tensor_parallel_engine_is_ready_with_every_shard_and_each_is_described_apart():
    """A TP=2 engine registers one storage per worker: the rank offers hits only once both
    are there; peers are told each worker's shard apart; one worker's release leaves the
    other registered, and the storages serve peers after both went."""
    _, layout, bb = engine_cache(8)

    async def run():
        actor = TransferActor(1, 2, "a", "127.0.0.1", 0, [])
        tiers = [TierConfig(Tier.CPU, 8 * bb, shared_memory=True)]
        actor._tp_size = 2
        actor._shards = {0: RankShard(SnapshotStorage(1, layout, tiers), None, 7, None)}
        assert not actor.is_ready()  # worker 1 not registered yet
        with pytest.raises(EngineNotRegisteredError, match="no storage of TP worker 1"):
            actor.storage_descriptor(1)
        actor._shards[1] = RankShard(SnapshotStorage(1, layout, tiers), None, 9, None)
        assert actor.is_ready()
        names = {k: actor.storage_descriptor(k)["tiers"][int(Tier.CPU)][1] for k in (0, 1)}
        assert names[0] != names[1]  # two storages, one per shard
        assert await actor.release_engine(9) and not actor.is_ready()
        assert actor._shards[0].owner == 7  # worker 0 still registered
        assert await actor.release_engine(7)
        assert actor.storage_descriptor(1)["tiers"]  # still serving peers
        await actor._close_runtime()
        assert actor._shards == {}

    asyncio.run(run())


@pytest.mark.parametrize("transport", ["xavier", "nixl", "sockets"])
def test_remote_route_follows_the_transport_option_on_this_host(transport):
    from xinference.model.llm.vllm.xavier.mechanism.nixl_endpoint import rdma_devices

    from .support.pools import nixl_available

    actor = TransferActor(1, 3, "127.0.0.1:1", "127.0.0.1", 0, [])
    actor._options = opts(vllm_transfer_backend_type=transport)
    auto = "nixl" if nixl_available() and rdma_devices() else "sockets"
    want = {"xavier": auto, "nixl": "nixl", "sockets": "sockets"}[transport]
    assert actor._remote_route() == want


def test_ipc_transport_refuses_a_peer_on_another_host():
    actor = TransferActor(1, 3, "127.0.0.1:1", "127.0.0.1", 0, [])
    actor._options = opts(vllm_transfer_backend_type="ipc")
    with pytest.raises(LookupError, match="transport is ipc"):
        actor._remote_route()


def test_automatic_transport_falls_back_to_sockets_when_no_nixl_endpoint_opens(monkeypatch):
    """A NIXL endpoint that cannot be opened (a fault this machine cannot cause: NIXL and UCX
    work here; the real endpoint is in test_nixl_endpoint.py): the automatic transport reads
    peers on other hosts over sockets from then on; the nixl transport fails the mapping
    (the load is recomputed) instead of silently using sockets."""
    from xinference.model.llm.vllm.xavier import transfer as transfer_mod

    async def actor_ref(address, uid):
        return object()

    async def no_endpoint(address):
        raise RuntimeError("UCX: no usable transport")

    monkeypatch.setattr(transfer_mod.xo, "actor_ref", actor_ref)
    monkeypatch.setattr(transfer_mod, "open_nixl_endpoint", no_endpoint)
    monkeypatch.setattr(transfer_mod, "nixl_importable", lambda: True)
    monkeypatch.setattr(transfer_mod, "rdma_devices", lambda: ["mlx5_0"])

    async def run(transport):
        actor = TransferActor(2, 3, "127.0.0.1:2", "127.0.0.1", 0,
                              ["127.0.0.1:0", "127.0.0.1:1", "127.0.0.1:2"])
        actor._options = opts(vllm_transfer_backend_type=transport)
        try:
            return actor, await actor.map_remote(1), None
        except RuntimeError as exc:
            return actor, None, exc

    actor, route, err = asyncio.run(run("xavier"))
    assert err is None and route == "sockets" and actor._stats == {"peers_mapped_sockets": 1}
    assert actor._remote[1][1] == actor.address  # staging rows under the pool's own address
    assert actor._remote_route() == "sockets"  # the endpoint is not tried again
    actor, route, err = asyncio.run(run("nixl"))
    assert "no usable transport" in str(err) and actor._stats == {}


@pytest.mark.parametrize("devices,transport,route", [
    (["mlx5_0"], "xavier", "nixl"), ([], "xavier", "sockets"), ([], "nixl", "nixl"),
    (["mlx5_0"], "sockets", "sockets")])
def test_automatic_transport_uses_nixl_across_hosts_only_with_an_rdma_device(
        monkeypatch, devices, transport, route):
    """Over plain TCP NIXL is no faster than sockets and its progress thread costs a core
    (doc/multi-host.md): the automatic transport takes it only where the host has an RDMA
    device; ``nixl`` forces it, ``sockets`` never takes it."""
    from xinference.model.llm.vllm.xavier import transfer as transfer_mod

    monkeypatch.setattr(transfer_mod, "nixl_importable", lambda: True)
    monkeypatch.setattr(transfer_mod, "rdma_devices", lambda: devices)
    actor = TransferActor(1, 3, "127.0.0.1:1", "127.0.0.1", 0, [])
    actor._options = opts(vllm_transfer_backend_type=transport)
    assert actor._remote_route() == route


def test_rdma_devices_lists_the_sysfs_class(tmp_path):
    from xinference.model.llm.vllm.xavier.mechanism.nixl_endpoint import rdma_devices

    assert rdma_devices(str(tmp_path / "absent")) == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


@pytest.mark.slow
def test_a_tp_worker_reads_the_same_shard_of_a_peer_on_another_host():
    """Two ranks' transfer actors in their own processes, each with a TP=2 engine's two
    storages: rank 2's worker 1 reads a slot of rank 1 (the route for peers on other hosts,
    ``copy_to`` over sockets) and gets rank 1's shard 1, never shard 0, in its own staging
    rows; worker 0 gets shard 0."""
    import dataclasses

    import xoscar as xo

    from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
    from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
    from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import open_shm, open_tier
    from xinference.model.llm.vllm.xavier.planning.options import (
        XavierOptions,
        transfer_actor_uid,
    )

    from .support.pools import actor_pool, sub_pool_addresses

    layout = layout_of({0: [torch.zeros(4, 2, 16, 8)]}, tp_size=2)
    bb = layout.groups[0].block_bytes

    async def run():
        async with actor_pool(n_process=2) as pool:
            subs = sub_pool_addresses(pool)
            tracker = await xo.create_actor(VLLMBlockTracker, address=pool.external_address,
                                            uid=f"{VLLMBlockTracker.default_uid()}-tp")
            world = [pool.external_address] + subs[:2]
            actors = {rank: await xo.create_actor(
                TransferActor, rank, 3, subs[rank - 1], "127.0.0.1", 0, world,
                address=subs[rank - 1], uid=transfer_actor_uid(rank)) for rank in (1, 2)}
            desc = {}
            for rank, actor in actors.items():
                opts = XavierOptions(rank=rank, rank_address=subs[rank - 1],
                                     block_tracker_address=tracker.address,
                                     block_tracker_uid=tracker.uid, gpu_budget_bytes=0,
                                     cpu_budget_bytes=8 * bb, transport="sockets",
                                     slab_blocks=4)
                assert not await actor.is_ready()
                # the two workers attach at the same moment (vLLM's collective_rpc)
                both = await asyncio.gather(*(actor.register_engine(
                    layout, opts, owner=10 * rank + k, device="cpu", tp_rank=k)
                    for k in (0, 1)))
                desc.update({(rank, k): d for k, d in enumerate(both)})
                assert await actor.is_ready()
            written = {}
            for k in (0, 1):  # rank 1's worker k stored shard k of one block in slot 3
                caches, release = open_tier(*desc[1, k]["tiers"][int(Tier.CPU)])
                caches[0][0][3].copy_(torch.full_like(caches[0][0][3], 1.5 + k))
                written[k] = caches[0][0][3].clone()
                release()
            for k in (0, 1):
                served, index = await actors[2].fetch_blocks(1, int(Tier.CPU), 0, [3], k)
                assert (served.bytes, index) == (bb, 0)  # one at a time: always row set 0
                # the slot's identity as rank 1's shard k holds it (the loader checks it)
                assert served.incarnation == desc[1, k]["generations"][1]
                assert len(served.generations) == 1
                staging = open_shm(desc[2, k]["staging"])[0][0][0]
                assert torch.equal(staging, written[k].reshape(-1).view(torch.uint8))
                other = written[1 - k].reshape(-1).view(torch.uint8)
                assert not torch.equal(staging, other)
            # a replica of another TP degree cannot join: its engine's attach (the launch)
            # fails, naming the option
            third = await xo.create_actor(
                TransferActor, 3, 4, subs[1], "127.0.0.1", 0, world, address=subs[1],
                uid=transfer_actor_uid(3))
            opts = XavierOptions(rank=3, rank_address=subs[1],
                                 block_tracker_address=tracker.address,
                                 block_tracker_uid=tracker.uid, gpu_budget_bytes=0,
                                 cpu_budget_bytes=8 * bb, transport="sockets", slab_blocks=4)
            with pytest.raises(Exception, match="tensor_parallel_size: rank 3 runs 1, the "
                                                "other replicas of the launch 2"):
                await third.register_engine(dataclasses.replace(layout, tp_size=1), opts,
                                            owner=30, device="cpu")
            assert not await third.is_ready()
            for actor in [*actors.values(), third]:
                await xo.destroy_actor(actor)

    asyncio.run(run())
