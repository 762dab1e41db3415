"""TransferActor's pure helpers: dropping rows of a load batch, reading destinations of a
malformed table, and the storage tiers it builds from the options (names in errors)."""

import numpy as np
import pytest
import torch

from xinference.model.llm.vllm.xavier.block_copy import block_view
from xinference.model.llm.vllm.xavier.gpu_transfer import GPUTransfer
from xinference.model.llm.vllm.xavier.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.load_batch import BlockLoad, LoadBatch, Tier
from xinference.model.llm.vllm.xavier.options import XavierOptions
from xinference.model.llm.vllm.xavier.snapshot_storage import (
    LocalDirectory,
    SnapshotStorage,
    TierConfig,
)
from xinference.model.llm.vllm.xavier.transfer import TransferActor, _dests, _without_rows


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


class _NoPeersMapped:
    def mapped(self):
        return []

    async def unmap_storage(self, rank):
        return 0


def test_unmappable_peer_is_not_looked_up_again_until_retry_time_or_new_address(monkeypatch):
    """A dead peer costs one failed lookup, not one per step; a world update that gives it
    a new address (recovery) allows the next try at once."""
    import asyncio

    from xinference.model.llm.vllm.xavier import transfer as transfer_mod

    actor = TransferActor(rank=2, world_size=3, rank_address="b", store_address="",
                          store_port=0, world_addresses=["m", "127.0.0.1:1", "b"])
    actor._transfer = _NoPeersMapped()
    tries = []

    async def failing_map(rank):
        tries.append(rank)
        raise ConnectionRefusedError("peer gone")

    monkeypatch.setattr(actor, "_map_peer", failing_map)
    clock = [100.0]
    monkeypatch.setattr(transfer_mod, "_monotonic", lambda: clock[0])

    async def run():
        assert await actor._ensure_mapped({(1, 0)}) == {1}
        assert await actor._ensure_mapped({(1, 0), (1, 1)}) == {1}  # within the wait
        assert tries == [1]
        clock[0] += transfer_mod.PEER_RETRY_S + 0.1
        assert await actor._ensure_mapped({(1, 0)}) == {1}
        assert tries == [1, 1]
        await actor.update_world(["m", "127.0.0.1:2", "b"])  # rank 1 recovered elsewhere
        assert await actor._ensure_mapped({(1, 0)}) == {1}
        assert tries == [1, 1, 1]

    asyncio.run(run())


def test_exports_start_a_background_make_room_only_above_a_lower_tier():
    """After each export the actor frees top-tier slots in the background (two tiers: the
    victims are demoted first, ``room_*`` counters); with one tier it does not (evicting
    ahead would only lose blocks).  Close waits for a make-room in flight."""
    import asyncio

    cache, layout, bb = engine_cache(64)

    async def run(tiers):
        actor = TransferActor(1, 2, "a", "127.0.0.1", 0, [])
        actor._storage = SnapshotStorage(1, layout, tiers, LocalDirectory())
        actor._engine_views = {0: [block_view(t, 0) for t in cache[0]]}
        for step in range(4):  # 4 x 4 blocks into a 16-block top tier
            await actor.export_blocks([(0, 10 * step + i, 1 + 4 * step + i) for i in range(4)])
            await asyncio.sleep(0.05)  # the engine's next forward pass
        await actor.export_blocks([(0, 100 + i, 20 + i) for i in range(4)])  # full: evicts
        room = actor._room_task
        storage = actor._storage
        await actor._close_runtime()
        return actor.counters(), room, storage

    two = [TierConfig(Tier.GPU, 16 * bb), TierConfig(Tier.CPU, 32 * bb)]
    c, room, storage = asyncio.run(run(two))
    assert room is not None and room.done()  # close waited for it
    # the export into the full tier found its 4 slots freed ahead (nothing demoted inline),
    # make-room demoted and freed them (4 = the largest export, a quarter of the tier)
    assert c["export_demoted"] == 0 and c["export_evicted"] == 0
    assert c["room_demoted"] >= 4 and c["room_evicted"] >= 4 and c["room_call_us"] > 0
    assert storage._closed

    c, room, _ = asyncio.run(run([TierConfig(Tier.CPU, 16 * bb)]))
    assert room is None and c["export_evicted"] == 4 and "room_call_us" not in c


def test_release_engine_names_its_owner_and_stops_exports_but_keeps_the_storage():
    """The worker's connector shutdown releases the engine: only the registering worker's
    pid does; afterwards exports are refused (the engine's caches are no longer mapped) and
    the storage still holds what was stored (peers read it until the actor goes)."""
    import asyncio

    cache, layout, bb = engine_cache(8)

    async def run():
        actor = TransferActor(1, 2, "a", "127.0.0.1", 0, [])
        actor._storage = SnapshotStorage(1, layout, [TierConfig(Tier.CPU, 8 * bb)],
                                         LocalDirectory())
        transfer = GPUTransfer(1)
        await transfer.set_local_caches({0: [("k", t) for t in cache[0]]}, {0: 0})
        actor._transfer, actor._engine_owner = transfer, 7
        actor._engine_views = {0: [block_view(t, 0) for t in cache[0]]}
        stored = await actor.export_blocks([(0, 11, 1)])
        assert not await actor.release_engine(8)  # another worker's late shutdown
        assert actor.is_ready() and not transfer.closed
        assert await actor.release_engine(7)
        assert not actor.is_ready() and transfer.closed
        refused = await actor.export_blocks([(0, 12, 2)])
        kept = actor._storage.lookup(0, 11) is not None
        await actor._close_runtime()
        return stored, refused, kept

    stored, refused, kept = asyncio.run(run())
    assert stored["export_exported"] == 1 and refused == {} and kept


@pytest.mark.parametrize("transport,same_host,route", [
    ("xavier", True, "ipc"), ("xavier", False, "nixl"), ("ipc", True, "ipc"),
    ("ipc", False, "sockets"), ("nixl", True, "nixl"), ("nixl", False, "nixl")])
def test_peer_route_follows_the_transport_option(transport, same_host, route):
    from .support.pools import nixl_available

    actor = TransferActor(1, 3, "127.0.0.1:1", "127.0.0.1", 0, [])
    actor._options = opts(vllm_transfer_backend_type=transport)
    want = "sockets" if route == "nixl" and transport == "xavier" and not nixl_available() \
        else route
    assert actor._peer_route(same_host) == want


class _RemoteMapsRecorded:
    def __init__(self):
        self.remote = []

    async def map_remote_storage(self, rank, tier, layout, fetch):
        self.remote.append((rank, tier, fetch))


def test_automatic_transport_falls_back_to_sockets_when_no_nixl_endpoint_opens(monkeypatch):
    """A NIXL endpoint that cannot be opened (a fault this machine cannot cause: NIXL and UCX
    work here; the real endpoint is in test_nixl_endpoint.py): the automatic transport reads
    peers on other hosts over sockets from then on; the nixl transport fails the mapping
    (the load is recomputed) instead of silently using sockets."""
    import asyncio

    from xinference.model.llm.vllm.xavier import transfer as transfer_mod

    class Peer:
        async def storage_descriptor(self):
            return {"host": "another-host/boot", "layout": None, "tiers": {1: ("shm", {})}}

    async def actor_ref(address, uid):
        return Peer()

    async def no_endpoint(address):
        raise RuntimeError("UCX: no usable transport")

    monkeypatch.setattr(transfer_mod.xo, "actor_ref", actor_ref)
    monkeypatch.setattr(transfer_mod, "open_nixl_endpoint", no_endpoint)
    monkeypatch.setattr(transfer_mod, "nixl_importable", lambda: True)
    fetch_addresses = []
    monkeypatch.setattr(transfer_mod, "xoscar_fetch",
                        lambda peer, address, tier: fetch_addresses.append(address) or address)

    async def run(transport):
        actor = TransferActor(2, 3, "127.0.0.1:2", "127.0.0.1", 0,
                              ["127.0.0.1:0", "127.0.0.1:1", "127.0.0.1:2"])
        actor._options = opts(vllm_transfer_backend_type=transport)
        actor._transfer = _RemoteMapsRecorded()
        try:
            await actor._map_peer(1)
        except RuntimeError as exc:
            return actor, exc
        return actor, None

    actor, err = asyncio.run(run("xavier"))
    assert err is None and actor._stats == {"peers_mapped_sockets": 1}
    assert fetch_addresses == [actor.address]  # staging rows under the pool's own address
    assert [(r, t) for r, t, _ in actor._transfer.remote] == [(1, Tier.CPU)]
    assert actor._peer_route(False) == "sockets"  # the endpoint is not tried again
    actor, err = asyncio.run(run("nixl"))
    assert "no usable transport" in str(err) and actor._stats == {}
