"""The TransferActor's own parts (storage tiers from the options, the engine's release, how
peers on other hosts are read) and the worker plane's pure helpers (dropping rows of a
load, destinations of a malformed table, peer retries and world updates)."""

import asyncio

import numpy as np
import pytest
import torch

from xinference.model.llm.vllm.xavier import worker_plane
from xinference.model.llm.vllm.xavier.actor_bridge import ActorBridge
from xinference.model.llm.vllm.xavier.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.load_batch import BlockLoad, LoadBatch, Tier
from xinference.model.llm.vllm.xavier.options import XavierOptions
from xinference.model.llm.vllm.xavier.snapshot_storage import SnapshotStorage, TierConfig
from xinference.model.llm.vllm.xavier.transfer import TransferActor
from xinference.model.llm.vllm.xavier.worker_plane import (
    WorkerDataPlane,
    _dests,
    _without_rows,
)


def batch():
    return LoadBatch.from_requests([
        ("a", [BlockLoad(0, 1, 1, 0, 10, 100), BlockLoad(0, 2, 2, 0, 11, 101)]),
        ("b", [BlockLoad(0, 3, 2, 1, 12, 102)]),
    ])


def test_without_rows_keeps_requests_and_offsets_consistent():
    b = batch()
    out = _without_rows(b, np.array([False, True, False]))
    assert out is not None and out.request_ids == ("a", "b")
    assert out.offsets.tolist() == [0, 1, 2] and out.table[:, 5].tolist() == [100, 102]
    assert _without_rows(b, np.zeros(3, bool)) is b
    assert _without_rows(b, np.ones(3, bool)) is None


def test_dests_of_malformed_tables():
    assert _dests(batch().table) == [100, 101, 102]
    assert _dests([[1, 2, 3]]) == []  # too few columns: nothing readable, no exception
    assert _dests("garbage") == []
    assert _dests(np.zeros((0, 6), np.int64)) == []


def engine_cache(blocks):
    """A one-group bf16 engine KV cache of ``blocks`` blocks, its layout, its block bytes."""
    cache = {0: [torch.zeros((blocks, 2, 16, 2, 8), dtype=torch.bfloat16) for _ in range(2)]}
    layout = layout_of(cache)
    return cache, layout, layout.groups[0].block_bytes


def opts(**kw):
    base = {"rank": 1, "rank_address": "a", "block_tracker_address": "b",
            "block_tracker_uid": "t"}
    return XavierOptions.from_xavier_config({**base, **kw}, {})


def test_tier_configs_from_options():
    layout = layout_of({0: [torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)]})
    block = layout.groups[0].block_bytes  # 4 KiB
    cpu_only = TransferActor._tier_configs(opts(xavier_gpu_budget=0, xavier_cpu_budget="64KiB"),
                                           layout, torch.device("cpu"))
    assert [(t.tier, t.budget_bytes, t.shared_memory) for t in cpu_only] == [
        (Tier.CPU, 64 * 1024, True)]
    # no GPU: both budgets make one shared-memory tier
    both = TransferActor._tier_configs(opts(xavier_gpu_budget="8KiB", xavier_cpu_budget="8KiB"),
                                       layout, torch.device("cpu"))
    assert [t.budget_bytes for t in both] == [16 * 1024]
    with pytest.raises(ValueError, match=r"xavier_cpu_budget: 1024 .* smaller than one KV block "
                                         rf"\({block} bytes\)"):
        TransferActor._tier_configs(opts(xavier_gpu_budget=0, xavier_cpu_budget="1KiB"),
                                    layout, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the .* bytes available"):
        TransferActor._tier_configs(opts(xavier_gpu_budget=0, xavier_cpu_budget="1000TiB"),
                                    layout, torch.device("cpu"))


def plane_of(rank=2, **kw):
    cache, _, _ = engine_cache(16)
    options = opts(**kw)
    options = XavierOptions(**{**vars(options), "rank": rank})
    return WorkerDataPlane(options, ActorBridge.shared(), {0: [(f"l{i}", t) for i, t in
                                                               enumerate(cache[0])]}, {0: 0})


def test_unmappable_peer_is_not_looked_up_again_until_retry_time_or_new_address(monkeypatch):
    """A dead peer costs one failed lookup, not one per step; a world update that gives it
    a new address (recovery) allows the next try at once."""
    plane = plane_of()
    plane.apply_world(["m", "127.0.0.1:1", "b"])
    tries = []

    def failing_map(rank):
        tries.append(rank)
        raise ConnectionRefusedError("peer gone")

    monkeypatch.setattr(plane, "_map_peer", failing_map)
    clock = [100.0]
    monkeypatch.setattr(worker_plane, "_monotonic", lambda: clock[0])
    assert plane._ensure_mapped({1}) == {1}
    assert plane._ensure_mapped({1}) == {1}  # within the wait: not tried
    assert tries == [1]
    clock[0] += worker_plane.PEER_RETRY_S + 0.1
    assert plane._ensure_mapped({1}) == {1}
    assert tries == [1, 1]
    plane.apply_world(["m", "127.0.0.1:2", "b"])  # rank 1 recovered elsewhere
    assert plane._ensure_mapped({1}) == {1}
    assert tries == [1, 1, 1]
    assert plane.counters.snapshot()["peer_map_failures"] == 3
    plane.close()


def test_a_world_update_drops_the_mappings_of_ranks_whose_address_changed():
    plane = plane_of()
    cache, _, _ = engine_cache(8)
    plane.apply_world(["m", "h:1", "h:2", "h:3"])
    for rank in (1, 3):
        plane.engine.map_storage(rank, Tier.CPU, cache)
    plane.apply_world(["m", "h:1", "h:2", ""])  # rank 3 died
    assert plane.engine.mapped() == [(1, Tier.CPU)]
    plane.close()
    plane.close()  # idempotent


def test_release_engine_names_its_owner_and_keeps_the_storage():
    """The worker's connector shutdown releases the engine: only the registering worker's
    pid does; afterwards the rank is not ready (no hits offered), and the storage still
    serves peers until the actor goes."""
    _, layout, bb = engine_cache(8)

    async def run():
        actor = TransferActor(1, 2, "a", "127.0.0.1", 0, [])
        actor._storage = SnapshotStorage(1, layout, [TierConfig(Tier.CPU, 8 * bb,
                                                                shared_memory=True)])
        actor._engine_owner = 7
        assert not await actor.release_engine(8)  # another worker's late shutdown
        assert actor.is_ready()
        assert await actor.release_engine(7)
        assert not actor.is_ready()
        kept = actor.storage_descriptor()["tiers"]
        await actor._close_runtime()
        return kept

    kept = asyncio.run(run())
    assert list(kept) == [int(Tier.CPU)] and kept[int(Tier.CPU)][0] == "shm"


@pytest.mark.parametrize("transport,route", [
    ("xavier", "nixl"), ("ipc", "sockets"), ("nixl", "nixl")])
def test_remote_route_follows_the_transport_option(transport, route):
    from .support.pools import nixl_available

    actor = TransferActor(1, 3, "127.0.0.1:1", "127.0.0.1", 0, [])
    actor._options = opts(vllm_transfer_backend_type=transport)
    want = "sockets" if route == "nixl" and transport == "xavier" and not nixl_available() \
        else route
    assert actor._remote_route() == want


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
