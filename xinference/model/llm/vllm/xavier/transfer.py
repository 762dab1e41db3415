"""``TransferActor``: one replica's transfer runtime (lives in the replica's subpool).

Created by Xinference's ``ModelActor.start_transfer_for_vllm`` with uid
``f"{TransferActor.default_uid()}-{rank}"`` in the model actor's pool, after the engine
is up.  The engine's vLLM worker moves the bytes of its own loads and exports
(:mod:`.vllm_side.worker_plane`); this actor holds what needs an actor:

* the rank's :class:`~.mechanism.snapshot_storage.SnapshotStorage`, allocated when the worker
  registers (:meth:`TransferActor.register_engine`, sized for the engine's KV layout:
  GPU tier on the engine's device, CPU tier in shared memory) and kept for the life of
  the replica; the worker and same-host peers map it.  A tensor-parallel replica has one
  per TP worker (a *shard*: that worker's KV heads), each registered, mapped and read
  apart: worker ``k`` of a peer maps and reads shard ``k`` (:mod:`.planning.shards`);
* reads for peers on other hosts (:meth:`serve_blocks`, xoscar ``copy_to``) and, for its
  own worker, reads from peers on other hosts (:meth:`map_remote`, :meth:`fetch_blocks`:
  received through NIXL at a ``nixl://`` address of its own where NIXL is installed, else
  over sockets, into staging rows the worker maps);
* the world (rank addresses): :meth:`update_world` tells the worker through one word of
  the counters file it shares with it (``world_epoch``);
* the rank's counters: the worker's (a shared-memory file it reads when asked) and its
  own, as Prometheus text too.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import xoscar as xo

from .block_tracker import VLLMBlockTracker
from .mechanism.in_place import CacheHandles
from .mechanism.kv_schema import KVLayout
from .mechanism.nixl_endpoint import (
    NixlEndpoint,
    nixl_importable,
    open_nixl_endpoint,
    rdma_devices,
)
from .mechanism.rank_shard import RankShard
from .mechanism.remote_fetch import RemoteFetchError, StagingSets, fetch_into, serve_blocks
from .mechanism.snapshot_storage import SnapshotStorage, pid_alive, tier_configs
from .planning.counters import SharedCounters, activity_line, prometheus_text, sum_snapshots
from .planning.load_batch import Tier
from .planning.log_names import package_logger
from .planning.options import TRANSFER_ACTOR_UID, XavierOptions, transfer_actor_uid
from .planning.routes import (
    ROUTE_NIXL,
    ROUTE_SOCKETS,
    XAVIER_TRANSPORT_BACKEND_KEY,
    XAVIER_TRANSPORT_NIXL,
    host_id,
    peer_route,
)

logger = package_logger(__name__)

#: how often each rank logs what it did (hit rate, loads, exports, storage), when it did
ACTIVITY_LOG_S = 30.0
#: how often each rank sends its counters to its Xinference worker's metrics endpoint
METRICS_PUSH_S = 5.0
#: the overlay's ``XavierMetricsSink`` in ``xinference.core.metrics``
#: (``_xinference_xavier_overlay.METRICS_SINK``)
METRICS_SINK = "xavier_counters"


class EngineNotRegisteredError(RuntimeError):
    """No engine (TP worker) registered here, or it was released: nothing to serve."""


class TransferActor(xo.StatelessActor):
    """A replica's transfer runtime (see the module docstring)."""

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
        #: TP rank -> what that worker registered (one entry without tensor parallelism)
        self._shards: Dict[int, RankShard] = {}
        #: the engine's tensor-parallel degree (from its workers' layouts)
        self._tp_size = 1
        #: the workers of a TP engine register at the same moment: one at a time, so that
        #: only the first of a new engine replaces the previous engine's storages
        self._registering = asyncio.Lock()
        self._tracker: Any = None
        self._options: Optional[XavierOptions] = None
        self._world_epoch = 0
        #: the NIXL address peers' copy_to writes into (opened on first need)
        self._endpoint: Optional[NixlEndpoint] = None
        #: opening the endpoint failed once: the automatic transport uses sockets from then on
        self._nixl_broken = False
        #: rank -> (peer actor ref, address its copy_to writes to) of peers on other hosts
        self._remote: Dict[int, Tuple[Any, str]] = {}
        self._stats: Dict[str, int] = {}
        #: the counters at the last activity log line (see :meth:`_log_activity`)
        self._logged: Dict[str, int] = {}
        self._activity: Optional[asyncio.Task[None]] = None
        #: this pool's Xinference worker (None: not looked up yet; False: there is none)
        self._metrics_worker: Any = None
        #: the counters last sent to it
        self._pushed: Dict[str, int] = {}

    # --------------------------------------------------------------- lifecycle
    async def register_engine(self, layout: KVLayout, options: XavierOptions,
                              owner: Optional[int] = None, device: str = "cpu",
                              counters_path: Optional[str] = None,
                              tp_rank: int = 0,
                              in_place: Optional[CacheHandles] = None) -> Dict[str, Any]:
        """A worker of this rank's engine registers (``owner``: its pid, which
        :meth:`release_engine` must name; ``tp_rank``: which TP worker it is, of
        ``layout.tp_size``): allocate its storage for ``layout`` on ``device`` (the
        worker's) and, for the engine's first worker, join the block directory.  Returns how
        the worker maps it (tiers, staging rows), this host's id and the world.  A worker
        registering again (its engine restarted) replaces everything of the previous
        engine, every shard.  A budget that holds no block fails, naming the option.
        ``in_place``: how peers map the worker's own vLLM cache (read in place)."""
        async with self._registering:
            desc = await self._register_engine(layout, options, owner, device, counters_path,
                                               tp_rank)
            self._shards[tp_rank].in_place = in_place
            return desc

    async def _register_engine(self, layout: KVLayout, options: XavierOptions,
                               owner: Optional[int], device: str,
                               counters_path: Optional[str], tp_rank: int) -> Dict[str, Any]:
        opts = options
        if not isinstance(opts, XavierOptions):
            raise TypeError(f"options: expected XavierOptions, got {type(opts).__name__}")
        if opts.rank != self.rank:
            raise ValueError(f"rank: engine of rank {opts.rank} registered with the transfer "
                             f"actor of rank {self.rank}")
        if not 0 <= tp_rank < layout.tp_size:
            raise ValueError(f"tp_rank: {tp_rank} outside tensor_parallel_size "
                             f"{layout.tp_size}")
        new_engine = (not self._shards or tp_rank in self._shards
                      or layout.tp_size != self._tp_size)
        if new_engine:
            await self._close_runtime()
        dev = torch.device(device)
        tiers = tier_configs(opts, layout, dev)
        tracker = await xo.actor_ref(opts.block_tracker_address, opts.block_tracker_uid)
        storage = SnapshotStorage(self.rank, layout, tiers)
        staging: Optional[StagingSets] = None
        try:
            staging = StagingSets(layout, opts.slab_blocks)
            if opts.transport == XAVIER_TRANSPORT_NIXL:  # fails the launch, naming the option
                try:
                    await self._nixl_address()
                except Exception as exc:
                    raise ValueError(f"{XAVIER_TRANSPORT_BACKEND_KEY}: nixl: cannot receive "
                                     f"through NIXL here: {exc}") from exc
            if new_engine:
                await tracker.unregister_rank(self.rank)  # blocks of a previous engine go
                await tracker.register_rank(self.rank, layout.tp_size)
        except BaseException:
            storage.close()
            if staging is not None:
                staging.close()
            raise
        counters = SharedCounters.open_checked(counters_path) if counters_path else None
        if counters is not None:
            counters.set("world_epoch", self._world_epoch)
        self._shards[tp_rank] = RankShard(storage, staging, owner, counters)
        self._tracker, self._options, self._tp_size = tracker, opts, layout.tp_size
        if self._activity is None:
            self._activity = asyncio.create_task(self._activity_loop())
        logger.info("transfer actor rank %d: engine worker %d/%d registered (%s, %s), "
                    "storage %s", self.rank, tp_rank, layout.tp_size, dev,
                    layout.fingerprint(),
                    ", ".join(f"{t.tier.name} {t.budget_bytes} B" for t in tiers))
        return {"host": host_id(), "tiers": storage.handles(),
                "generations": storage.generations_handle(), "staging": staging.handles(0),
                "world": list(self.world_addresses), "layout": layout}

    async def release_engine(self, owner: Optional[int] = None) -> bool:
        """A worker of the engine is shutting down (it calls this from vLLM's connector
        shutdown, after it let go of every mapping): its shard is no longer registered.
        The storage stays and keeps serving peers until the actor is destroyed.  ``owner``:
        the pid given to :meth:`register_engine`; a release from any other process (an
        engine that was replaced since) changes nothing.  Returns whether a worker was
        released."""
        shard = next((sh for sh in self._shards.values()
                      if owner is not None and sh.owner == owner), None)
        if shard is None:
            return False
        shard.owner = None
        if shard.release_in_place() and self._tracker is not None:  # its cache goes with it
            try:
                await self._tracker.forget(self.rank, int(Tier.VLLM), None)
            except Exception as exc:  # the entries then fail their readers' checks
                logger.info("transfer actor rank %d: forget: %r", self.rank, exc)
        if any(sh.owner is not None for sh in self._shards.values()):
            return True
        self._remote.clear()
        await self._close_endpoint()
        logger.info("transfer actor rank %d: engine released; storage serves peers until "
                    "the actor goes", self.rank)
        return True

    def is_ready(self) -> bool:
        """Every worker of the engine registered (attached): sharing can start."""
        return (len(self._shards) == self._tp_size
                and all(sh.owner is not None for sh in self._shards.values()))

    async def update_world(self, world_addresses: List[str]) -> None:
        """New rank addresses (a rank recovered or died): the worker drops the mappings of
        every rank whose address changed before its next load (it reads the new world from
        here); peers are mapped again on next use."""
        old = self.world_addresses
        self.world_addresses = list(world_addresses)
        for rank in range(max(len(old), len(world_addresses))):
            was = old[rank] if rank < len(old) else ""
            now = world_addresses[rank] if rank < len(world_addresses) else ""
            if was != now:
                self._remote.pop(rank, None)
        self._world_epoch += 1
        for shard in self._shards.values():
            if shard.counters is not None:
                shard.counters.set("world_epoch", self._world_epoch)
        logger.info("transfer actor rank %d: world %s", self.rank, world_addresses)

    def world(self) -> List[str]:
        return list(self.world_addresses)

    async def __pre_destroy__(self) -> None:
        if self._activity is not None:
            self._activity.cancel()
            self._activity = None
        await self._close_runtime()

    async def _activity_loop(self) -> None:
        waited = 0.0
        while True:
            await asyncio.sleep(METRICS_PUSH_S)
            await self._push_metrics()
            waited += METRICS_PUSH_S
            if waited >= ACTIVITY_LOG_S:
                waited = 0.0
                self._log_activity()

    def _metric_labels(self) -> Dict[str, str]:
        """``model`` (Xinference's model uid) and ``replica`` (Xinference's replica index:
        rank 1 is replica 0)."""
        uid = self._options.block_tracker_uid if self._options is not None else ""
        stem = f"{VLLMBlockTracker.default_uid()}-"
        return {"model": uid[len(stem):] if uid.startswith(stem) else uid,
                "replica": str(self.rank - 1)}

    async def _worker_for_metrics(self) -> Any:
        """The Xinference worker of this sub pool (its main pool), or None without one."""
        if self._metrics_worker is None:
            self._metrics_worker = False
            try:
                config = await xo.get_pool_config(self.address)
                main = config.get_external_addresses()[0]
                if main != self.address:
                    self._metrics_worker = await xo.actor_ref(main, "worker")
            except Exception as exc:  # test pools, other hosts of Xavier: counters stay here
                logger.info("transfer actor rank %d: no Xinference worker to send metrics "
                            "to (%s); counters() and metrics_text() have them", self.rank, exc)
        return self._metrics_worker or None

    async def _push_metrics(self, op: str = "set") -> None:
        """Send this rank's counters (``op="set"``, when they changed) or the removal of its
        series (``"remove"``) through ``WorkerActor.record_metrics``; failures are logged."""
        try:
            worker = await self._worker_for_metrics()
            if worker is None:
                return
            if op == "remove":
                await worker.record_metrics(METRICS_SINK, "remove",
                                            {"labels": self._metric_labels()})
                self._pushed = {}
                return
            now = self.counters()
            if now != self._pushed:
                await worker.record_metrics(METRICS_SINK, "set",
                                            {"labels": self._metric_labels(), "values": now})
                self._pushed = now
        except Exception as exc:  # metrics never stop the rank
            logger.info("transfer actor rank %d: metrics %s failed: %r", self.rank, op, exc)

    def _log_activity(self) -> Optional[str]:
        """Log what this rank did since the last line (nothing when it did nothing)."""
        now = self.counters()
        line = activity_line(self.rank, now, self._logged)
        if line is not None:
            self._logged = now
            logger.info(line)
        return line

    async def _close_runtime(self) -> None:
        if self._pushed:
            await self._push_metrics("remove")
        shards, self._shards = self._shards, {}
        self._remote.clear()
        await self._close_endpoint()
        for shard in shards.values():
            shard.close()
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
    def _shard(self, tp_rank: int) -> RankShard:
        shard = self._shards.get(int(tp_rank))
        if shard is None:
            raise EngineNotRegisteredError(f"rank {self.rank}: no storage of TP worker "
                                           f"{tp_rank} (engine not registered)")
        return shard

    def storage_descriptor(self, tp_rank: int = 0) -> Dict[str, Any]:
        """How peers map this rank's storage of TP worker ``tp_rank`` (same host) or read
        it (other hosts)."""
        return self._shard(tp_rank).descriptor(host_id())

    def in_place_generations(self) -> List[Any]:
        """The block generations of every TP worker's vLLM cache (the scheduler bumps them
        all), once each worker shared its cache in place; else empty."""
        shards = [self._shards.get(k) for k in range(self._tp_size)]
        # a crashed engine's workers never released: their pids are gone (same host)
        if any(sh is None or sh.in_place is None or not pid_alive(sh.owner) for sh in shards):
            return []
        return [sh.in_place.generations for sh in shards if sh is not None and sh.in_place]

    async def serve_blocks(self, tier: int, group: int, slots: Sequence[int],
                           refs: Sequence[Any], tp_rank: int = 0) -> Tuple[int, int, List[int]]:
        """A peer on another host reads ``slots`` of shard ``tp_rank``'s ``tier`` (its
        snapshot tiers under leases, its vLLM cache in place) into ``refs``; the answer:
        bytes sent, the slots' identity (``ServedBlocks``)."""
        served = await serve_blocks(self._shard(tp_rank).source(tier), tier, group, slots, refs)
        self._add_stats({"served_blocks": len(slots), "served_bytes": served.bytes})
        return served

    async def map_remote(self, rank: int) -> str:
        """Prepare reads from ``rank`` on another host for this rank's worker; returns the
        route: ``nixl`` (copy_to received at this actor's NIXL endpoint) or ``sockets``."""
        if rank >= len(self.world_addresses) or not self.world_addresses[rank]:
            raise LookupError(f"rank {rank}: no address known (world {self.world_addresses})")
        peer = await xo.actor_ref(self.world_addresses[rank], transfer_actor_uid(rank))
        route = self._remote_route()
        address = self.address
        if route == ROUTE_NIXL:
            try:
                address = await self._nixl_address()
            except Exception as exc:
                if self._options is not None and self._options.transport == XAVIER_TRANSPORT_NIXL:
                    raise  # asked for: the load fails (recomputed), the next one tries again
                logger.warning("transfer actor rank %d: no NIXL endpoint (%r): peers on other "
                               "hosts are read over sockets", self.rank, exc)
                self._nixl_broken = True
                route = ROUTE_SOCKETS
        self._remote[rank] = (peer, address)
        self._add_stats({f"peers_mapped_{route}": 1})
        logger.info("transfer actor rank %d: rank %d read through %s", self.rank, rank,
                    f"copy_to through NIXL into {address}" if route == ROUTE_NIXL
                    else "copy_to over sockets")
        return route

    def _remote_route(self) -> str:
        """``nixl`` where NIXL can be used and pays (an RDMA device; the ``nixl`` transport:
        always), else ``sockets``; ``LookupError`` for the ``ipc`` transport (it never reads another
        host)."""
        transport = self._options.transport if self._options is not None else ""
        usable = not self._nixl_broken and nixl_importable() and bool(rdma_devices())
        return peer_route(transport, False, usable)

    async def fetch_blocks(self, rank: int, tier: int, group: int,
                           slots: Sequence[int], tp_rank: int = 0) -> Tuple[Any, int]:
        """For this rank's TP worker ``tp_rank``: read ``slots`` of ``rank``'s shard
        ``tp_rank``, ``tier``/``group``, into staging rows it maps (rows
        ``0..len(slots)-1`` of one row set).  Returns the source's answer (``ServedBlocks``)
        and which row set holds the rows (:meth:`staging_handles` maps a set the worker
        has not seen).  A call that comes while another still runs (the worker, one call
        at a time, gave up on it) gets the other set, so the old call's late write never
        lands in its rows; with both sets held, ``StagingBusyError`` (recomputed)."""
        shard = self._shard(tp_rank)
        if shard.owner is None or shard.staging is None:
            raise EngineNotRegisteredError(f"rank {self.rank}: TP worker {tp_rank} not registered")
        if rank not in self._remote:
            await self.map_remote(rank)
        peer, address = self._remote[rank]
        staging = shard.staging
        overlaps = staging.overlaps
        try:
            with staging.taken() as index:
                if staging.overlaps != overlaps:
                    self._add_stats({"remote_fetch_overlaps": 1})
                rows = staging.rows(index, group, len(slots))
                served = await fetch_into(peer, address, tier, group, slots, rows, tp_rank)
        except RemoteFetchError as exc:  # both sets held, rows missing: recomputed
            self._add_stats({exc.counter: 1})
            raise
        self._add_stats({"remote_fetches": 1, "remote_bytes": served.bytes})
        return served, index

    def staging_handles(self, tp_rank: int = 0, index: int = 0) -> Dict[int, Any]:
        """How TP worker ``tp_rank`` maps its staging row set ``index``."""
        shard = self._shard(tp_rank)
        if shard.staging is None:
            raise EngineNotRegisteredError(f"rank {self.rank}: TP worker {tp_rank} not registered")
        return shard.staging.handles(index)

    # --------------------------------------------------------------- counters
    def _add_stats(self, stats: Dict[str, int]) -> None:
        for k, v in stats.items():
            self._stats[k] = self._stats.get(k, 0) + int(v)

    def counters(self) -> Dict[str, int]:
        """This rank's counters: its workers' (read now from the files they share; summed
        over the TP workers, the largest of a ``*_max_us``) and this actor's own."""
        workers = [sh.counters.snapshot() for sh in self._shards.values() if sh.counters]
        for worker in workers:
            worker.pop("world_epoch", None)
        total = sum_snapshots(*workers, self._stats)
        for key in [k for k in total if k.endswith("_max_us")]:
            total[key] = max((w.get(key, 0) for w in workers), default=total[key])
        return total

    def metrics_text(self) -> str:
        return prometheus_text(self.counters(), {"rank": str(self.rank)})

    def pid(self) -> int:
        return os.getpid()
