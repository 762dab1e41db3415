"""Replica-side actors for the multi-process storage tests: a rank that owns an
engine KV cache and a snapshot storage (its GPU tier in shared memory, or on the GPU with
``device="cuda"``) and writes it as a worker does, and a rank that loads.

Imported by the package's installed name (``_xinference_xavier_fork``: the same modules as
``xinference.model.llm.vllm.xavier.*``, see ``_xinference_xavier_overlay``), so that the
sub pools that unpickle these actors do not import upstream's ``xinference.model``
(~20 s of CPU per process on the 2-core machine).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any, Coroutine, Dict, List, Sequence, Tuple, TypeVar

import numpy as np
import torch
import xoscar as xo

from _xinference_xavier_fork.block_tracker import VLLMBlockTracker
from _xinference_xavier_fork.mechanism.block_copy import block_view
from _xinference_xavier_fork.mechanism.gpu_transfer import GPUTransfer
from _xinference_xavier_fork.mechanism.kv_schema import layout_of
from _xinference_xavier_fork.mechanism.load_handle import FetchedRows
from _xinference_xavier_fork.mechanism.read_checks import SourceIdentity
from _xinference_xavier_fork.mechanism.remote_fetch import ServedBlocks, fetch_into, serve_blocks
from _xinference_xavier_fork.mechanism.slot_generations import SlotGenerations
from _xinference_xavier_fork.mechanism.snapshot_storage import (
    SnapshotStorage,
    TierConfig,
    open_tier,
)
from _xinference_xavier_fork.mechanism.storage_writer import StorageWriter
from _xinference_xavier_fork.planning.load_batch import BlockLoad, LoadBatch, Tier
from _xinference_xavier_fork.planning.plan import SlabConfig

from .pools import actor_pool, sub_pool_addresses

LAYERS, BLOCK, N_BLOCKS = 3, (2, 16, 8), 64
T = TypeVar("T")


def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the actor's loop from another thread (the writer's and the load
    engine's threads call the directory this way, as the worker does through its bridge)."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


class ActorDirectory:
    """The storage writer's directory link over the tracker actor ref."""

    def __init__(self, tracker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._tracker, self._loop = tracker, loop

    def register(self, rank: int, entries: Sequence[Any], incarnation: int = 0) -> int:
        return on_loop(self._loop, self._tracker.register(rank, [list(e) for e in entries],
                                                          incarnation))

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return on_loop(self._loop, self._tracker.claim(rank, tier, group, list(slots)))

    def move(self, rank: int, entries: Sequence[Any], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        return on_loop(self._loop, self._tracker.move(rank, [list(e) for e in entries], tier,
                                                      group, list(slots), incarnation))


def engine_cache(seed: int, device: str = "cpu") -> Dict[int, List[torch.Tensor]]:
    """Random bf16 bit patterns (NaNs included), the same for a seed on every device."""
    gen = torch.Generator().manual_seed(seed)
    return {0: [torch.randint(-2**15, 2**15 - 1, (N_BLOCKS, *BLOCK), dtype=torch.int16,
                              generator=gen).view(torch.bfloat16).to(device)
                for _ in range(LAYERS)]}


def digest(layers: Sequence[torch.Tensor], block: int) -> str:
    h = hashlib.sha256()
    for t in layers:
        h.update(t[block].contiguous().view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()


class _RankActor(xo.StatelessActor):
    """What both ranks answer about their engine cache (``self.cache``)."""

    cache: Dict[int, List[torch.Tensor]]

    def block_digests(self, blocks: List[int]) -> List[str]:
        return [digest(self.cache[0], b) for b in blocks]

    def cuda_device(self) -> Dict[str, Any]:
        """The GPU this rank's cache is on, named so that two processes can compare:
        ``uuid`` (unique per GPU whatever ``CUDA_VISIBLE_DEVICES`` says), the PCI location,
        and this process's ``CUDA_VISIBLE_DEVICES``."""
        t = self.cache[0][0]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if t.device.type != "cuda":
            return {"device": str(t.device), "visible": visible, "uuid": None}
        p = torch.cuda.get_device_properties(t.device)
        pci = (f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:"
               f"{getattr(p, 'pci_device_id', 0):02x}")
        return {"device": str(t.device), "name": p.name, "visible": visible, "pci": pci,
                "uuid": str(p.uuid)}


class StorageRankActor(_RankActor):
    """An exporting rank: its storage (the transfer actor's part) and the worker's writer of
    it in one process.  ``room_blocks``: free top-tier slots kept by :meth:`make_room`."""

    def __init__(self, rank: int, tracker_address: str, tracker_uid: str, gpu_blocks: int,
                 cpu_blocks: int, seed: int, device: str = "cpu", room_blocks: int = 0) -> None:
        super().__init__()
        self._rank, self._seed, self._device = rank, seed, device
        self._tracker = (tracker_address, tracker_uid)
        self._tiers = (gpu_blocks, cpu_blocks)
        self._room = room_blocks

    async def __post_create__(self) -> None:
        tracker = await xo.actor_ref(address=self._tracker[0], uid=self._tracker[1])
        await tracker.register_rank(self._rank)
        self.cache = engine_cache(self._seed, self._device)
        layout = layout_of(self.cache)
        per_block = layout.groups[0].block_bytes
        gpu_bytes = self._tiers[0] * per_block
        tiers = [TierConfig(Tier.GPU, gpu_bytes, device=self._device) if self._device != "cpu"
                 else TierConfig(Tier.GPU, gpu_bytes, shared_memory=True)]
        if self._tiers[1]:
            tiers.append(TierConfig(Tier.CPU, self._tiers[1] * per_block, shared_memory=True))
        self.storage = SnapshotStorage(self._rank, layout, tiers)
        device = torch.device(self._device)
        self.writer = StorageWriter(
            self._rank, layout, {t: self.storage.caches(t) for t in self.storage.tiers},
            ActorDirectory(tracker, asyncio.get_running_loop()), device,
            stream=torch.cuda.Stream() if device.type == "cuda" else None,
            room_blocks=self._room, background_room=False,
            generations=self.storage.generations)
        self.views = {0: [block_view(t, 0) for t in self.cache[0]]}

    async def export(self, blocks: List[Tuple[int, int, int]]) -> Dict[str, int]:
        """Export (never waits), then wait until published (the writer's threads call the
        directory through this actor's loop: never block it)."""
        res = self.writer.export(self.views, blocks)
        assert await asyncio.to_thread(self.writer.flush, 30)
        return vars(res)

    async def make_room(self, free_blocks: int) -> int:
        """What the worker's room thread does between steps: demote and claim LRU victims."""
        return await asyncio.to_thread(self.writer.make_room, free_blocks)

    def where(self, key: int) -> Any:
        hit = self.writer.lookup(0, key)
        return None if hit is None else (int(hit[0]), hit[1])

    def handles(self) -> Dict[int, Any]:
        """Per tier, ``("shm", handles)`` or ``("ipc", handles)`` for a CUDA tier."""
        return self.storage.handles()

    def generations_handle(self) -> Any:
        """How a reader of this host maps the slots' generations."""
        return self.storage.generations_handle()

    def incarnation(self) -> int:
        return self.storage.generations.incarnation

    def storage_layouts(self) -> Dict[int, Any]:
        return {int(t): layout_of(self.storage.caches(t)) for t in self.storage.tiers}

    async def serve_blocks(self, tier: int, group: int, slots: Any, refs: List[Any],
                           tp_rank: int = 0) -> ServedBlocks:
        return await serve_blocks(self.storage, tier, group, slots, refs)

    async def close(self) -> None:
        await asyncio.to_thread(self.writer.close)
        self.storage.close()


class LoaderRankActor(_RankActor):
    """A loading rank: its engine cache and load engine (the worker's part) in one process.
    ``validate_reads=False``: the negative control of the checks after each copy."""

    def __init__(self, rank: int, tracker_address: str, tracker_uid: str,
                 device: str = "cpu", validate_reads: bool = True) -> None:
        super().__init__()
        self._rank, self._device = rank, device
        self._validate = validate_reads
        self._tracker_addr = (tracker_address, tracker_uid)

    async def __post_create__(self) -> None:
        self.tracker = await xo.actor_ref(address=self._tracker_addr[0], uid=self._tracker_addr[1])
        self.cache = engine_cache(1000 + self._rank, self._device)
        self._loop = asyncio.get_running_loop()
        self.engine = GPUTransfer(self._rank, SlabConfig(16, 4, 2),
                                  validate_reads=self._validate)
        self.engine.set_local_caches(self.cache)

    def map_peer(self, rank: int, handles: Dict[int, Any], generations: Any = None) -> None:
        """Map a same-host peer's tiers from :meth:`StorageRankActor.handles` and its
        slot generations (:meth:`StorageRankActor.generations_handle`: what reads are
        checked against; left open with the process, as a test's mapping)."""
        gens = SlotGenerations.open(generations) if generations is not None else None
        for tier, (kind, h) in handles.items():
            caches, release = open_tier(kind, h)
            self.engine.map_storage(rank, Tier(tier), caches, 0, release, gens)

    async def map_remote_peer(self, rank: int, address: str, uid: str,
                              layouts: Dict[int, Any]) -> None:
        """Map ``rank``'s tiers as another host's: blocks come through xoscar copy_to into
        staging rows of this process (the transfer actor's part of a real rank)."""
        source = await xo.actor_ref(address=address, uid=uid)
        for tier, layout in layouts.items():
            staging = [torch.empty((16, la.block_bytes), dtype=torch.uint8)
                       for la in layout.group(0).layers]

            def fetch(t: Any, tier: int = tier, staging: List[torch.Tensor] = staging
                      ) -> FetchedRows:
                rows = [s[:t.rows] for s in staging]
                served = on_loop(self._loop, fetch_into(source, self.address, tier, t.group,
                                                        t.src_slots.tolist(), rows))
                return FetchedRows(rows, SourceIdentity(
                    served.incarnation, np.asarray(served.generations, np.int64)))

            self.engine.map_remote_storage(rank, Tier(tier), layout, fetch)

    def counters(self) -> Dict[str, int]:
        return self.engine.counters.snapshot()

    def unmap_peer(self, rank: int) -> int:
        return self.engine.unmap_storage(rank)

    def stale_ranks(self) -> List[int]:
        """Peers whose mapping a check found to be of another incarnation (since asked)."""
        return sorted(self.engine.take_stale_ranks())

    async def query(self, keys: List[int]) -> Any:
        return await self.tracker.query(0, keys, self._rank)

    async def soak(self, keys: List[int], loads: int, every: int) -> List[Dict[str, int]]:
        """``loads`` query + load rounds of ``keys`` (real directory, real copies); this
        process's open file descriptors and RSS every ``every`` loads."""
        import psutil

        proc = psutil.Process()
        samples = []
        dests = list(range(1, len(keys) + 1))  # block 0 is vLLM's null block: never written
        for i in range(1, loads + 1):
            res = await self.load(await self.query(keys), dests)
            if res["error"] is not None or res["written"] != len(keys):
                raise AssertionError(f"load {i}: {res}")
            if i % every == 0:
                samples.append({"loads": i, "fds": proc.num_fds(),
                                "rss": proc.memory_info().rss})
        return samples

    async def load(self, result: Any, dests: List[int]) -> Dict[str, Any]:
        """Load a query result (as the worker does) and report the destinations' bytes."""
        loads = [BlockLoad(0, k, loc.rank, loc.tier, loc.slot, d, loc.generation,
                           loc.incarnation)
                 for k, loc, d in zip(result.keys, result.locations, dests)]
        try:
            handle = self.engine.load_gpu_requests_v1(
                LoadBatch.from_requests([("req", loads)]))
            res = await asyncio.to_thread(handle.wait, 60)
            error = None
        except Exception as exc:  # reported to the test, like the worker would
            res, error = None, f"{type(exc).__name__}: {exc}"
        finally:  # the load is done (or refused): the scheduler half's release
            await self.tracker.release(list(result.lease_ids))
        return {"written": res.blocks_written if res else 0, "error": error,
                "failed": sorted(res.failed) if res else [],
                "tiers": [int(loc.tier) for loc in result.locations],
                "digests": [digest(self.cache[0], d) for d in dests[:len(result.keys)]]}

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)


async def storage_world(gpu_blocks: int, cpu_blocks: int, remote: bool = False,
                        scheme: str = "") -> Tuple[Any, Any, Any, Any]:
    """The directory, an exporting rank (1) and a loading rank (2), each in its own sub pool
    of a new pool: ``(pool context, tracker, rank 1, rank 2)``; the caller leaves the pool
    context (``await pool_cm.__aexit__(None, None, None)``)."""
    pool_cm = actor_pool(n_process=3, scheme=scheme)
    pool = await pool_cm.__aenter__()
    tracker, a, b = await storage_actors(sub_pool_addresses(pool), gpu_blocks, cpu_blocks,
                                         remote)
    return pool_cm, tracker, a, b


async def storage_actors(addresses: Sequence[str], gpu_blocks: int, cpu_blocks: int,
                         remote: bool = False, tag: str = "", validate_reads: bool = True
                         ) -> Tuple[Any, Any, Any]:
    """:func:`storage_world`'s actors in three sub pools of an existing pool (``tag`` tells
    apart the actors of several tests sharing the pools): ``(tracker, rank 1, rank 2)``;
    rank 2 maps rank 1 as a peer of this host, or of another host (``remote``)."""
    t_addr, a_addr, b_addr = addresses
    uid = tracker_uid(tag)
    tracker = await xo.create_actor(VLLMBlockTracker, address=t_addr, uid=uid)
    a = await xo.create_actor(StorageRankActor, 1, t_addr, uid, gpu_blocks, cpu_blocks, 7,
                              address=a_addr, uid=f"rank-1{tag}")
    b = await xo.create_actor(LoaderRankActor, 2, t_addr, uid, "cpu", validate_reads,
                              address=b_addr, uid=f"rank-2{tag}")
    if remote:
        await b.map_remote_peer(1, a_addr, f"rank-1{tag}", await a.storage_layouts())
    else:
        await b.map_peer(1, await a.handles(), await a.generations_handle())
    return tracker, a, b


def tracker_uid(tag: str = "") -> str:
    """The uid of :func:`storage_actors`' tracker for ``tag``."""
    return f"{VLLMBlockTracker.default_uid()}-model{tag}"


async def destroy(tracker: Any, *ranks: Any) -> None:
    """Close and destroy the rank actors ``ranks``, then ``tracker``, of a test that shares
    its pools."""
    for rank in ranks:
        await rank.close()
        await xo.destroy_actor(rank)
    await xo.destroy_actor(tracker)
