"""``TransferActor``: one replica's transfer runtime (lives in the replica's subpool).

Created by Xinference's ``ModelActor.start_transfer_for_vllm`` with uid
``f"{TransferActor.default_uid()}-{rank}"`` in the model actor's pool, after the
engine is up.  The engine's worker-side connector finds it lazily and hands it the
KV caches (:meth:`TransferActor.register_engine`); from then on the actor

* owns the rank's :class:`~.snapshot_storage.SnapshotStorage` (GPU tier on the
  engine's device, CPU tier in shared memory) and exports blocks into it;
* runs the batched load engine (:class:`~.gpu_transfer.GPUTransfer`): ONE
  :meth:`load_gpu_requests_v1` per scheduler step with loads;
* maps peers' storages on first use: CUDA IPC / shared memory on this host,
  xoscar ``copy_to`` from another host, received through NIXL at a ``nixl://`` address of
  its own (:mod:`~.nixl_endpoint`) where NIXL is installed, else over sockets; the
  ``nixl`` transport sends every peer through NIXL, the ``ipc`` one never;
* keeps the counters and exports them as Prometheus text.

Every load releases its leases (through :class:`~.gpu_transfer.GPUTransfer`) and
reports the destination blocks that were not written, so vLLM recomputes them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import xoscar as xo

from .budget import validate_budget
from .counters import elapsed_us, prometheus_text
from .gpu_transfer import GPUTransfer, Lease, LoadError, TransferClosedError
from .kv_handles import CacheHandles, open_handles
from .kv_schema import KVLayout, layout_of
from .lease_release import CoalescingReleaser
from .load_batch import DEST, GROUP, KEY, RANK, TIER, LoadBatch, LoadBatchError, Tier
from .nixl_endpoint import NixlEndpoint, nixl_importable, open_nixl_endpoint
from .options import TRANSFER_ACTOR_UID, XavierOptions
from .plan import SlabConfig
from .remote_fetch import serve_blocks, xoscar_fetch
from .scheduler_side import ExportRow, StepMeta
from .snapshot_storage import SnapshotStorage, TierConfig, open_ipc, open_shm
from .transport import XAVIER_TRANSPORT_BACKEND_KEY, XAVIER_TRANSPORT_IPC, XAVIER_TRANSPORT_NIXL

logger = logging.getLogger(__name__)

RECENT_LOADS = 4096
#: a peer that could not be mapped is not tried again for this long (its loads fail fast:
#: vLLM recomputes); a world update naming a new address for it ends the wait
PEER_RETRY_S = 5.0
#: longest a peer lookup + mapping may hold a load call (the engine's step waits for it)
PEER_MAP_TIMEOUT_S = 10.0
#: at close, how long a background make-room in flight may still run
ROOM_CLOSE_TIMEOUT_S = 30.0
_monotonic = time.monotonic  # the peer-retry clock (tests move it)
#: test-only fault modes (:meth:`TransferActor.inject_fault`)
FAULTS = ("skip_copy", "fail_one_block", "stall_load")
#: how long a ``stall_load`` fault holds a load call (after its leases were granted,
#: before any peer is mapped or byte copied): the window in which a test kills the source
STALL_LOAD_S = 3.0


def host_id() -> str:
    """Same value in every process of one booted host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class TransferActor(xo.StatelessActor):
    @classmethod
    def default_uid(cls) -> str:
        return TRANSFER_ACTOR_UID

    def __init__(self, rank: int, world_size: int, rank_address: str, store_address: str,
                 store_port: int, world_addresses: List[str]) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.rank_address = rank_address
        self.world_addresses = list(world_addresses or [])
        self._transfer: Optional[GPUTransfer] = None
        self._storage: Optional[SnapshotStorage] = None
        self._tracker: Any = None
        self._releaser = CoalescingReleaser(self._release_ids)
        self._options: Optional[XavierOptions] = None
        self._device: Optional[torch.device] = None
        self._engine_views: Dict[int, List[torch.Tensor]] = {}
        self._engine_owner: Optional[int] = None
        #: the NIXL address peers' copy_to writes into (opened on first need)
        self._endpoint: Optional[NixlEndpoint] = None
        #: opening the endpoint failed once: the automatic transport uses sockets from then on
        self._nixl_broken = False
        self._layout: Optional[KVLayout] = None
        self._peer_lock = asyncio.Lock()
        #: rank -> monotonic time before which it is not looked up again
        self._peer_retry_at: Dict[int, float] = {}
        self._stats: Dict[str, int] = {}
        self._faults: Dict[str, int] = {}
        #: the background make-room task (at most one) and the free slots it keeps
        self._room_task: Optional[asyncio.Task[None]] = None
        self._room_blocks = 0
        #: (group, key) -> destination block of recent successful loads (for digests)
        self._recent_loads: OrderedDict[Tuple[int, int], int] = OrderedDict()
        #: (group, key) -> engine block of recent exports (for consistency checks)
        self._recent_exports: OrderedDict[Tuple[int, int], int] = OrderedDict()
        #: (group, block id) of blocks a ``fail_one_block`` fault zeroed and reported
        self.fault_blocks: List[Tuple[int, int]] = []

    # --------------------------------------------------------------- lifecycle
    async def register_engine(self, handles: CacheHandles, options: Dict[str, Any],
                              owner: Optional[int] = None) -> str:
        """Map the engine's KV caches, create the storage, join the directory.
        Returns the KV layout fingerprint.  A second call (engine restarted) replaces
        everything of the previous engine.  ``owner``: the registering worker's pid, which
        :meth:`release_engine` must name."""
        opts = XavierOptions(**options)
        if opts.rank != self.rank:
            raise ValueError(f"rank: engine of rank {opts.rank} registered with the transfer "
                             f"actor of rank {self.rank}")
        await self._close_runtime()
        caches = open_handles(handles)
        layout = layout_of(caches, handles.block_dims)
        device = next(t for layers in caches.values() for _, t in layers).device
        tracker = await xo.actor_ref(opts.block_tracker_address, opts.block_tracker_uid)
        tiers = self._tier_configs(opts, layout, device)
        storage = SnapshotStorage(self.rank, layout, tiers, tracker)
        slabs = SlabConfig(full_rows=opts.slab_blocks, small_rows=min(32, opts.slab_blocks))
        transfer = GPUTransfer(self.rank, slab_config=slabs, release_lease=self._release_lease)
        await transfer.set_local_caches(caches, handles.block_dims)
        if opts.transport == XAVIER_TRANSPORT_NIXL:  # fails the launch, naming the option
            try:
                await self._nixl_address()
            except Exception as exc:
                await transfer.close()
                storage.close()
                raise ValueError(f"{XAVIER_TRANSPORT_BACKEND_KEY}: nixl: cannot receive "
                                 f"through NIXL here: {exc}") from exc
        await tracker.unregister_rank(self.rank)  # blocks of a previous engine are gone
        await tracker.register_rank(self.rank)
        self._tracker, self._storage, self._transfer = tracker, storage, transfer
        self._options, self._device, self._layout = opts, device, layout
        self._engine_views = transfer.local_block_views
        self._engine_owner = owner
        logger.info("transfer actor rank %d: engine registered (%s, %s), storage %s", self.rank,
                    device, layout.fingerprint(),
                    ", ".join(f"{t.tier.name} {t.budget_bytes} B" for t in tiers))
        return layout.fingerprint()

    @staticmethod
    def _tier_configs(opts: XavierOptions, layout: KVLayout,
                      device: torch.device) -> List[TierConfig]:
        """Storage tiers for ``opts``; a budget that holds no block (of every group), or a CPU
        tier larger than /dev/shm's free space, fails naming the option and the value."""
        block_bytes = sum(g.block_bytes for g in layout.groups)
        tiers = []
        if device.type == "cuda" and opts.gpu_budget_bytes > 0:
            budget = validate_budget("xavier_gpu_budget", opts.gpu_budget_bytes, block_bytes)
            tiers.append(TierConfig(Tier.GPU, budget, device=str(device)))
        cpu_bytes = opts.cpu_budget_bytes
        option = "xavier_cpu_budget"
        if device.type == "cpu" and opts.gpu_budget_bytes:
            # no GPU: one tier in shared memory holds both budgets
            cpu_bytes += opts.gpu_budget_bytes
            option = "xavier_gpu_budget + xavier_cpu_budget"
        if cpu_bytes > 0:
            budget = validate_budget(option, cpu_bytes, block_bytes,
                                     available_bytes=_shm_free_bytes())
            tiers.append(TierConfig(Tier.CPU, budget, shared_memory=True,
                                    pin=device.type == "cuda"))
        if not tiers:
            raise ValueError("xavier_cpu_budget: no storage tier on this device (the GPU tier "
                             "needs a CUDA engine): set xavier_cpu_budget above 0")
        return tiers

    async def release_engine(self, owner: Optional[int] = None) -> bool:
        """The engine is shutting down (its worker calls this from vLLM's connector
        shutdown, before the worker process frees its KV caches): close the transfer
        engine, which unmaps the engine's KV caches and every peer's storage, so that no
        process still maps memory its owner frees (CUDA IPC: the importer lets go first).
        The storage stays and keeps serving peers until the actor is destroyed; loads and
        exports are refused from now on.  ``owner``: the pid given to
        :meth:`register_engine`; a release from any other worker (an engine that was
        replaced since) changes nothing.  Returns whether an engine was released."""
        transfer = self._transfer
        if transfer is None or owner != self._engine_owner:
            return False
        self._transfer, self._engine_views, self._engine_owner = None, {}, None
        await transfer.close()
        await self._close_endpoint()
        logger.info("transfer actor rank %d: engine released; storage serves peers until "
                    "the actor goes", self.rank)
        return True

    def is_ready(self) -> bool:
        return self._transfer is not None

    async def update_world(self, world_addresses: List[str]) -> None:
        """New rank addresses (a rank recovered or died): the mappings of every rank whose
        address changed are dropped; peers are mapped again on next use."""
        old = self.world_addresses
        self.world_addresses = list(world_addresses)
        if self._transfer is None:
            return
        for rank in range(max(len(old), len(world_addresses))):
            was = old[rank] if rank < len(old) else ""
            now = world_addresses[rank] if rank < len(world_addresses) else ""
            if rank != self.rank and was != now:
                self._peer_retry_at.pop(rank, None)
                await self._transfer.unmap_storage(rank)
        logger.info("transfer actor rank %d: world %s", self.rank, world_addresses)

    def world(self) -> List[str]:
        return list(self.world_addresses)

    async def __pre_destroy__(self) -> None:
        await self._close_runtime()

    async def _close_runtime(self) -> None:
        transfer, storage = self._transfer, self._storage
        self._transfer = self._storage = None
        room, self._room_task = self._room_task, None
        if room is not None:  # let a demotion in flight finish: it holds the storage lock
            await asyncio.wait([room], timeout=ROOM_CLOSE_TIMEOUT_S)
        if transfer is not None:
            await transfer.close()
        await self._close_endpoint()
        if storage is not None:
            storage.close()
        if self._tracker is not None:
            try:
                await self._tracker.unregister_rank(self.rank)
            except Exception as exc:  # the directory may be gone first at termination
                logger.info("transfer actor rank %d: unregister: %s", self.rank, exc)

    async def _nixl_address(self) -> str:
        """This actor's NIXL endpoint address (the endpoint is opened on first use)."""
        if self._endpoint is None:
            self._endpoint = await open_nixl_endpoint(self.address)
        return self._endpoint.address

    async def _close_endpoint(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            try:
                await endpoint.close()
            except Exception as exc:  # a stop that fails leaks a listening port, no more
                logger.warning("transfer actor rank %d: closing %s: %r", self.rank,
                               endpoint.address, exc)

    # -------------------------------------------------------------- peer view
    def storage_descriptor(self) -> Dict[str, Any]:
        """How peers map this rank's storage."""
        if self._storage is None:
            raise TransferClosedError(f"rank {self.rank}: no storage (engine not registered)")
        tiers: Dict[int, Tuple[str, Any]] = {}
        for tier in (Tier.GPU, Tier.CPU):
            t = self._storage._tiers.get(tier)
            if t is None:
                continue
            if t.config.shared_memory:
                tiers[int(tier)] = ("shm", self._storage.shm_handles(tier))
            else:
                tiers[int(tier)] = ("ipc", self._storage.ipc_handles(tier))
        return {"host": host_id(), "layout": self._storage.layout, "tiers": tiers}

    async def serve_blocks(self, tier: int, group: int, slots: Sequence[int],
                           refs: Sequence[Any]) -> int:
        if self._storage is None:
            raise TransferClosedError(f"rank {self.rank}: no storage")
        return await serve_blocks(self._storage, tier, group, slots, refs)

    async def _map_peer(self, rank: int) -> None:
        assert self._transfer is not None
        if rank >= len(self.world_addresses) or not self.world_addresses[rank]:
            raise LookupError(f"rank {rank}: no address known (world {self.world_addresses})")
        peer = await xo.actor_ref(self.world_addresses[rank], f"{TRANSFER_ACTOR_UID}-{rank}")
        desc = await peer.storage_descriptor()
        route = self._peer_route(desc["host"] == host_id())
        address = self.address
        if route == "nixl":
            try:
                address = await self._nixl_address()
            except Exception as exc:
                if self._options is not None and self._options.transport == XAVIER_TRANSPORT_NIXL:
                    raise  # asked for: the load fails (recomputed), the next one tries again
                logger.warning("transfer actor rank %d: no NIXL endpoint (%r): peers on other "
                               "hosts are read over sockets", self.rank, exc)
                self._nixl_broken = True
                route = "sockets"
        for tier, (kind, handles) in desc["tiers"].items():
            if route == "ipc":
                caches = open_shm(handles) if kind == "shm" else open_ipc(handles)
                await self._transfer.map_storage(rank, Tier(tier), caches)
            else:
                await self._transfer.map_remote_storage(
                    rank, Tier(tier), desc["layout"], xoscar_fetch(peer, address, tier))
        self._add_stats({f"peers_mapped_{route}": 1})
        logger.info("transfer actor rank %d: mapped rank %d (%s)", self.rank, rank, {
            "ipc": "same host", "nixl": f"copy_to through NIXL into {address}",
            "sockets": "copy_to over sockets"}[route])

    def _peer_route(self, same_host: bool) -> str:
        """How a peer's storage is read: ``ipc`` (mapped: CUDA IPC / shared memory, same
        host only), ``nixl`` (copy_to received at this actor's NIXL endpoint) or
        ``sockets`` (copy_to over the pools' sockets).  The ``nixl`` transport sends every
        peer through NIXL (replicas in separate containers of one host share no IPC);
        otherwise a peer on this host is mapped, one on another host goes through NIXL
        where NIXL is installed and its endpoint opened (the ``ipc`` transport: never)."""
        transport = self._options.transport if self._options is not None else ""
        if transport == XAVIER_TRANSPORT_NIXL:
            return "nixl"
        if same_host:
            return "ipc"
        if transport != XAVIER_TRANSPORT_IPC and not self._nixl_broken and nixl_importable():
            return "nixl"
        return "sockets"

    async def _ensure_mapped(self, pairs: Set[Tuple[int, int]]) -> Set[int]:
        """Map every source rank of ``pairs``; returns the ranks that could not be mapped."""
        assert self._transfer is not None
        failed: Set[int] = set()
        async with self._peer_lock:
            mapped = set(self._transfer.mapped())
            for rank in sorted({r for r, _ in pairs}):
                if all((r, Tier(t)) in mapped for r, t in pairs if r == rank):
                    continue
                if _monotonic() < self._peer_retry_at.get(rank, 0.0):
                    failed.add(rank)
                    continue
                try:
                    await asyncio.wait_for(self._map_peer(rank), PEER_MAP_TIMEOUT_S)
                    self._peer_retry_at.pop(rank, None)
                except Exception as exc:
                    logger.warning("transfer actor rank %d: cannot map rank %d (next try in "
                                   "%.0f s): %r", self.rank, rank, PEER_RETRY_S, exc)
                    self._peer_retry_at[rank] = _monotonic() + PEER_RETRY_S
                    failed.add(rank)
        return failed

    # ------------------------------------------------------------------ loads
    async def load_gpu_requests_v1(self, meta: StepMeta) -> Dict[str, Any]:
        """Execute one step's loads.  Returns ``failed``: destination block ids (all groups)
        that were not written and must be recomputed, and the step's figures.  The call's
        wall time is counted in ``load_call_us``."""
        with elapsed_us(lambda us: self._add_stats({"load_call_us": us})):
            return await self._load_step(meta)

    async def _load_step(self, meta: StepMeta) -> Dict[str, Any]:
        self._add_stats(meta.stats.as_dict())
        leases = [Lease(int(lid), int(rank)) for lid, rank in meta.leases]
        transfer = self._transfer
        if transfer is None:
            await self._release_all(leases)
            return {"failed": _dests(meta.table), "written": 0,
                    "error": "transfer actor has no engine registered"}
        if self._faults.get("stall_load", 0) > 0 and meta.table.shape[0]:
            self._faults["stall_load"] -= 1
            self._add_stats({"faults_stall_load": 1})
            await asyncio.sleep(STALL_LOAD_S)
        try:
            batch: Optional[LoadBatch] = meta.load_batch()
        except LoadBatchError as exc:
            await self._release_all(leases)
            self._add_stats({"rejected_metadata": 1})
            logger.warning("transfer actor rank %d: malformed step metadata: %s", self.rank, exc)
            return {"failed": _dests(meta.table), "written": 0, "error": str(exc)}
        assert batch is not None
        tiers = batch.table[:, TIER]
        self._add_stats({"rows_from_gpu_tier": int((tiers == Tier.GPU).sum()),
                         "rows_from_cpu_tier": int((tiers == Tier.CPU).sum())})
        failed: Set[int] = set()
        unreachable = await self._ensure_mapped(
            {(int(r), int(t)) for r, t in batch.table[:, [RANK, TIER]]})
        if unreachable:
            drop = np.isin(batch.table[:, RANK], list(unreachable))
            self._add_stats({"rows_unreachable": int(drop.sum())})
            failed.update(int(x) for x in batch.table[drop, DEST])
            batch = _without_rows(batch, drop)
        if batch is not None:
            batch, faulted = await self._apply_faults(batch)
            failed.update(faulted)
        if batch is None:
            await self._release_all(leases)
            return {"failed": sorted(failed), "written": 0}
        try:
            result = await transfer.load_gpu_requests_v1(batch, leases)
        except LoadError as exc:  # copies started: every planned destination is suspect
            failed.update(int(x) for ids in exc.planned.values() for x in ids)
            return {"failed": sorted(failed), "written": 0, "error": str(exc)}
        except Exception as exc:  # rejected before any copy (conflict, bad ids, closed, ...)
            failed.update(int(x) for x in batch.table[:, DEST])
            return {"failed": sorted(failed), "written": 0, "error": f"{type(exc).__name__}: {exc}"}
        self._remember_loads(batch, failed)
        return {"failed": sorted(failed), "written": result.blocks_written}

    def _remember_loads(self, batch: LoadBatch, failed: Set[int]) -> None:
        _remember(self._recent_loads, (
            (group, key, dest) for group, key, dest in zip(
                batch.table[:, GROUP].tolist(), batch.table[:, KEY].tolist(),
                batch.table[:, DEST].tolist()) if dest not in failed))

    async def _apply_faults(self, batch: LoadBatch) -> Tuple[Optional[LoadBatch], Set[int]]:
        """Test-only faults (a fault vLLM cannot be made to produce on demand)."""
        if self._faults.get("skip_copy", 0) > 0 and batch.num_rows:
            self._faults["skip_copy"] -= 1
            for g in set(int(x) for x in batch.table[:, GROUP]):
                rows = batch.table[batch.table[:, GROUP] == g]
                self._zero_blocks(g, rows[:, DEST])
            self._add_stats({"faults_skip_copy": 1})
            return None, set()  # claims success: nothing reported failed
        if self._faults.get("fail_one_block", 0) > 0 and batch.num_rows:
            self._faults["fail_one_block"] -= 1
            victim = batch.num_rows // 2
            row = batch.table[victim]
            self._zero_blocks(int(row[GROUP]), [int(row[DEST])])  # garbage stays if not redone
            self.fault_blocks.append((int(row[GROUP]), int(row[DEST])))
            drop = np.zeros(batch.num_rows, bool)
            drop[victim] = True
            self._add_stats({"faults_fail_one_block": 1})
            return _without_rows(batch, drop), {int(row[DEST])}
        return batch, set()

    def _zero_blocks(self, group: int, block_ids: Any) -> None:
        idx = torch.as_tensor(np.asarray(block_ids, np.int64))
        for v in self._engine_views.get(group, []):
            v.index_fill_(0, idx.to(v.device), 0)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    async def _release_all(self, leases: Sequence[Lease]) -> None:
        if leases and self._tracker is not None:
            try:
                await self._release_ids([lease.lease_id for lease in leases])
            except Exception as exc:
                logger.warning("transfer actor rank %d: lease release failed: %s", self.rank, exc)

    async def _release_lease(self, lease: Lease) -> None:
        # a step's leases are released concurrently: coalesced into one directory call
        await self._releaser.release(lease.lease_id)

    async def _release_ids(self, lease_ids: Sequence[int]) -> None:
        await self._tracker.release(list(lease_ids))

    # ---------------------------------------------------------------- exports
    async def export_blocks(self, rows: Sequence[ExportRow],
                            stats: Optional[Dict[str, int]] = None) -> Dict[str, int]:
        """Store newly computed full blocks ``(group, key, block_id)`` and publish them.
        ``stats``: scheduler-side figures of steps without loads (summed into the counters).
        The wall time of the copy and publication is counted in ``export_call_us``."""
        if stats:
            self._add_stats(stats)
        if self._storage is None or not self._engine_views or not rows:
            return {}  # no engine (released or never registered): nothing to read from
        with elapsed_us(lambda us: self._add_stats({"export_call_us": us})):
            res = await self._storage.export(self._engine_views, list(rows))
        _remember(self._recent_exports, rows)
        out = {f"export_{k}": v for k, v in vars(res).items()}
        self._add_stats(out)
        self._schedule_room(len(rows))
        return out

    def _schedule_room(self, step_blocks: int) -> None:
        """After an export, free the top tier ahead of the next one in the background
        (:meth:`SnapshotStorage.make_room`): the demotions and claims a full tier needs
        then run while the engine computes its next step instead of inside the export
        the worker waits for.  Only where there is a lower tier to demote into.  Keeps as
        many slots free as the largest export seen, at most a quarter of the top tier.
        Counted as ``room_*`` (``room_call_us``: wall time; ``room_demoted``, ...)."""
        storage = self._storage
        if storage is None or len(storage.tiers) < 2:  # no tier to demote into: evicting
            return  # ahead would only lose blocks early; an export's own eviction is cheap
        if self._room_task is not None and not self._room_task.done():
            return
        top_slots = storage.slots(storage.tiers[0])
        self._room_blocks = min(max(self._room_blocks, step_blocks), top_slots // 4)
        if self._room_blocks > 0:
            self._room_task = asyncio.ensure_future(self._make_room(storage, self._room_blocks))

    async def _make_room(self, storage: SnapshotStorage, blocks: int) -> None:
        try:
            with elapsed_us(lambda us: self._add_stats({"room_call_us": us})):
                res = await storage.make_room(blocks)
            self._add_stats({f"room_{k}": v for k, v in vars(res).items() if v})
        except Exception as exc:  # the next export evicts what it needs itself
            logger.warning("transfer actor rank %d: make_room: %s", self.rank, exc)

    # --------------------------------------------------------------- counters
    def _add_stats(self, stats: Dict[str, int]) -> None:
        for k, v in stats.items():
            self._stats[k] = self._stats.get(k, 0) + int(v)

    def counters(self) -> Dict[str, int]:
        out = dict(self._stats)
        if self._transfer is not None:
            out.update(self._transfer.counters.snapshot())
        if self._storage is not None:
            for tier in self._storage.tiers:
                out[f"storage_{tier.name.lower()}_used_blocks"] = self._storage.used(tier)
        return out

    def metrics_text(self) -> str:
        return prometheus_text(self.counters(), {"rank": str(self.rank)})

    # ------------------------------------------------------------ inspection
    def loaded_block_digests(self) -> Dict[Tuple[int, int], str]:
        """SHA-256 of the bytes now in the engine blocks that recent loads wrote, per
        ``(group, key)`` (compare with the source's :meth:`stored_block_digests`)."""
        return {gk: _digest(self._engine_views.get(gk[0], []), block)
                for gk, block in self._recent_loads.items()}

    def stored_vs_engine_mismatches(self) -> List[Tuple[int, int]]:
        """Recently exported ``(group, key)`` whose stored bytes differ from the engine block
        they were exported from (empty unless wrong KV was published, or vLLM has since
        reused that engine block)."""
        stored = self.stored_block_digests(list(self._recent_exports))
        return [gk for gk, block in self._recent_exports.items()
                if gk in stored and stored[gk] != _digest(self._engine_views[gk[0]], block)]

    def reset_recent_loads(self) -> None:
        self._recent_exports.clear()
        self._recent_loads.clear()
        self.fault_blocks.clear()

    def recorded_faults(self) -> List[Tuple[int, int]]:
        return list(self.fault_blocks)

    def engine_block_digests(self, group: int, block_ids: Sequence[int]) -> List[str]:
        """SHA-256 of engine blocks (tests: "nothing half-written")."""
        views = self._engine_views.get(int(group), [])
        return [_digest(views, int(b)) for b in block_ids]

    def recent_export_keys(self) -> List[Tuple[int, int]]:
        """``(group, key)`` of recent exports, oldest first (tests)."""
        return list(self._recent_exports)

    def engine_num_blocks(self, group: int = 0) -> int:
        views = self._engine_views.get(int(group), [])
        return int(views[0].shape[0]) if views else 0

    def engine_block_is_zero(self, group: int, block_id: int) -> bool:
        """Whether every byte of engine block ``block_id`` of ``group`` is zero."""
        views = self._engine_views.get(int(group), [])
        return all(not bool(v[int(block_id)].any()) for v in views)

    def stored_block_digests(self, keys: Sequence[Tuple[int, int]]) -> Dict[Tuple[int, int], str]:
        """SHA-256 of the stored bytes of ``(group, key)`` blocks this rank holds."""
        out: Dict[Tuple[int, int], str] = {}
        if self._storage is None:
            return out
        for group, key in keys:
            hit = self._storage.lookup(int(group), int(key))
            if hit is not None:
                tier, slot, _ = hit
                views = self._storage._tiers[tier].views[int(group)]
                out[(int(group), int(key))] = _digest(views, slot)
        return out

    def inject_fault(self, mode: str, count: int = 1) -> None:
        if mode not in FAULTS:
            raise ValueError(f"mode: expected one of {FAULTS}, got {mode!r}")
        self._faults[mode] = int(count)

    def pid(self) -> int:
        return os.getpid()


def _without_rows(batch: LoadBatch, drop: np.ndarray) -> Optional[LoadBatch]:
    """``batch`` minus the rows in ``drop`` (requests left without rows stay, empty)."""
    if not drop.any():
        return batch
    keep = ~drop
    if not keep.any():
        return None
    req = batch.row_request_index()[keep]
    counts = np.bincount(req, minlength=batch.num_requests)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return LoadBatch(batch.request_ids, offsets, batch.table[keep].copy())


def _digest(views: Sequence[torch.Tensor], block: int) -> str:
    h = hashlib.sha256()
    for v in views:
        h.update(v[block].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _dests(table: Any) -> List[int]:
    """Destination block ids of a (possibly malformed) load table; [] when unreadable."""
    try:
        arr = np.asarray(table)
        return sorted({int(x) for x in arr[:, DEST]}) if arr.ndim == 2 and arr.size else []
    except Exception:
        return []


def _shm_free_bytes() -> Optional[int]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _remember(recent: OrderedDict[Tuple[int, int], int],
              rows: Iterable[Tuple[int, int, int]]) -> None:
    """Record ``(group, key) -> block`` rows as the newest, keeping the last
    :data:`RECENT_LOADS` (the inspection methods' bounded memory)."""
    for group, key, block in rows:
        gk = (int(group), int(key))
        recent[gk] = int(block)
        recent.move_to_end(gk)
    while len(recent) > RECENT_LOADS:
        recent.popitem(last=False)
