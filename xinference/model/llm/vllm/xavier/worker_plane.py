"""The data plane of one vLLM worker: loads, exports and peers, inside the worker process.

The worker owns the KV caches and the CUDA context, so it moves the bytes itself; no
xoscar call sits on a step's path for same-host traffic.  :class:`WorkerDataPlane`

* attaches to its rank's ``TransferActor`` once (:meth:`attach`): the actor allocates the
  rank's storage for this engine's KV layout and answers how to map it; the plane maps
  every tier (CUDA IPC / shared memory) and keeps its slots (:class:`~.storage_writer.
  StorageWriter`);
* loads each step's blocks with ONE ``load_gpu_requests_v1`` (:class:`~.gpu_transfer.
  GPUTransfer`) on the engine's own CUDA stream (:meth:`load`); a peer of this host is
  mapped once (CUDA IPC or its shared-memory files), a peer of another host is read
  through the rank's transfer actor (NIXL or sockets, into staging rows shared with it);
* tells vLLM which requests' loads are complete and which blocks failed
  (:meth:`finished`), ordering vLLM's stream after the copies first;
* exports each step's newly full blocks (:meth:`export`) without waiting;
* writes its counters into a shared-memory file the transfer actor reads when asked;
  the actor bumps ``world_epoch`` there when the world changed (a rank died or came
  back), and the next load drops the mappings of every rank whose address changed.

A request opted out of sharing never reaches it.  Test-only switches (faults, digests)
exist only with ``XAVIER_TEST_HOOKS=1`` in the engine's environment
(:mod:`.worker_hooks`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from .actor_bridge import ActorBridge, LazyActor
from .counters import SharedCounters, elapsed_us
from .gpu_transfer import GPUTransfer, Lease, LoadHandle
from .kv_schema import KVLayout, layout_of
from .lease_release import BatchingReleaser, directory_sender
from .load_batch import DEST, RANK, TIER, LoadBatch, LoadBatchError, Tier
from .options import TRANSFER_ACTOR_UID, XavierOptions
from .plan import SlabConfig
from .scheduler_side import StepMeta
from .snapshot_storage import open_shm, open_tier
from .storage_writer import Entry, StorageWriter
from .transport import XAVIER_TRANSPORT_IPC, XAVIER_TRANSPORT_NIXL

logger = logging.getLogger(__name__)

#: longest an actor call of the plane may take (attach, peer lookup, remote fetch)
CALL_TIMEOUT_S = 30.0
#: a peer that could not be mapped is not tried again for this long (its loads fail fast:
#: vLLM recomputes); a world update ends the wait
PEER_RETRY_S = 5.0
PEER_MAP_TIMEOUT_S = 10.0
TEST_HOOKS_ENV = "XAVIER_TEST_HOOKS"
_monotonic = time.monotonic  # the peer-retry clock (tests move it)

GroupedLayers = Dict[int, List[Tuple[str, torch.Tensor]]]


class TrackerLink:
    """The storage writer's :class:`~.storage_writer.DirectoryLink`: blocking calls to the
    ``VLLMBlockTracker`` through the bridge (made off the step thread)."""

    def __init__(self, bridge: ActorBridge, tracker: LazyActor) -> None:
        self._bridge, self._tracker = bridge, tracker

    def _ref(self) -> Any:
        return self._tracker.get()  # unchecked: a ref without a lookup

    def register(self, rank: int, entries: Sequence[Entry]) -> int:
        ref, rows = self._ref(), [tuple(int(x) for x in e) for e in entries]
        try:
            return int(self._bridge.call(lambda: ref.register(rank, rows), CALL_TIMEOUT_S))
        except Exception:
            self._tracker.forget()
            raise

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        ref, ids = self._ref(), [int(s) for s in slots]
        try:
            return list(self._bridge.call(lambda: ref.claim(rank, tier, group, ids),
                                          CALL_TIMEOUT_S))
        except Exception:
            self._tracker.forget()
            raise

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int]) -> List[int]:
        ref, ids = self._ref(), [int(s) for s in slots]
        rows = [tuple(int(x) for x in e) for e in entries]
        try:
            return list(self._bridge.call(lambda: ref.move(rank, rows, tier, group, ids),
                                          CALL_TIMEOUT_S))
        except Exception:
            self._tracker.forget()
            raise


@dataclass
class _StepLoad:
    """One step's loads until vLLM is told they are done."""

    request_ids: Tuple[str, ...]
    handles: List[LoadHandle] = field(default_factory=list)
    failed: Set[int] = field(default_factory=set)
    #: why (part of) the step's loads were refused, if they were
    error: Optional[str] = None

    def reportable(self) -> bool:
        return all(h.reportable for h in self.handles)


class WorkerDataPlane:
    """See the module docstring.  Built by the worker connector at ``register_kv_caches``."""

    def __init__(self, options: XavierOptions, bridge: ActorBridge, caches: GroupedLayers,
                 block_dims: Dict[int, int]) -> None:
        self.options = options
        self.rank = options.rank
        self._bridge = bridge
        self._transfer = LazyActor(bridge, options.rank_address, options.transfer_actor_uid)
        self._tracker = LazyActor(bridge, options.block_tracker_address,
                                  options.block_tracker_uid, checked=False)
        self.counters = SharedCounters.create()
        self.layout: KVLayout = layout_of(caches, block_dims)
        self.device = next(t for layers in caches.values() for _, t in layers).device
        self._releaser = BatchingReleaser(directory_sender(self._tracker, bridge.start),
                                          bridge.schedule)
        slabs = SlabConfig(full_rows=options.slab_blocks,
                           small_rows=min(32, options.slab_blocks))
        self.engine = GPUTransfer(self.rank, slab_config=slabs,
                                  release_lease=lambda lease: self._releaser.release(
                                      lease.lease_id),
                                  counters=self.counters)
        self.engine.set_local_caches(caches, block_dims)
        self.writer: Optional[StorageWriter] = None
        self.batched_loads = options.batched_loads
        self._attached = False
        self._world: List[str] = []
        self._world_epoch = 0
        self._peer_retry_at: Dict[int, float] = {}
        self._staging: Dict[int, List[torch.Tensor]] = {}
        self._own_releases: List[Any] = []
        self._host = ""
        self._pending: List[_StepLoad] = []
        self._closed = False
        self.hooks: Optional[Any] = None
        if os.environ.get(TEST_HOOKS_ENV) == "1":
            from .worker_hooks import WorkerHooks

            self.hooks = WorkerHooks(self)

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def engine_views(self) -> Dict[int, List[torch.Tensor]]:
        return self.engine.local_block_views

    # -------------------------------------------------------------- attaching
    def attach(self, force: bool = False, raise_errors: bool = False) -> bool:
        """Register this engine with the rank's transfer actor (at most once a second
        unless ``force``) and map the storage it allocates.  ``raise_errors``: a refused
        registration (e.g. a budget that holds no block) raises instead of being logged."""
        if self._attached or self._closed:
            return self._attached
        if force:
            self._transfer.forget()
        ref = self._transfer.get(timeout=CALL_TIMEOUT_S)
        if ref is None:
            return False
        opts = dict(vars(self.options))
        device = str(self.device)
        path = self.counters.path
        try:
            desc = self._bridge.call(lambda: ref.register_engine(
                self.layout, opts, owner=os.getpid(), device=device, counters_path=path),
                timeout=CALL_TIMEOUT_S * 10)
            self._open_storage(desc)
        except Exception as exc:
            logger.warning("xavier: rank %d: registering the KV caches failed: %s",
                           self.rank, exc)
            self._transfer.forget()
            if raise_errors:
                raise
            return False
        self._attached = True
        logger.info("xavier: rank %d attached to its transfer actor (layout %s, tiers %s)",
                    self.rank, self.layout.fingerprint(),
                    ", ".join(t.name for t in self.writer.tiers) if self.writer else "-")
        return True

    def _open_storage(self, desc: Dict[str, Any]) -> None:
        pin = self.device.type == "cuda"
        tiers: Dict[Tier, Dict[int, List[torch.Tensor]]] = {}
        for tier, (kind, handles) in sorted(desc["tiers"].items()):
            caches, release = open_tier(kind, handles, pin=pin)
            tiers[Tier(tier)] = caches
            self._own_releases.append(release)
        self._staging = {g: list(ts) for g, ts in open_shm(desc["staging"]).items()}
        self.writer = StorageWriter(self.rank, self.layout, tiers, TrackerLink(
            self._bridge, self._tracker), self.device, stream=self.engine.stream,
            counters=self.counters, room_blocks=self.options.slab_blocks)
        self._host = str(desc["host"])
        self._world = list(desc.get("world") or [])
        self._world_epoch = self.counters.get("world_epoch")

    # ------------------------------------------------------------------ loads
    def load(self, step: StepMeta) -> None:
        """Launch every load of ``step`` (vLLM's ``start_load_kv``); never waits for a copy
        (a CPU engine copies right away).  Failures become failed blocks for vLLM."""
        if not step.has_loads:
            return
        with elapsed_us(lambda us: self.counters.add("load_launch_us", us)):
            self._pending.append(self._load(step))

    def run_detached(self, step: StepMeta) -> Tuple[_StepLoad, Optional[str]]:
        """Launch ``step``'s loads outside vLLM's bookkeeping (never reported through
        :meth:`finished`): the test hooks' ``raw_load``."""
        pending = self._load(step)
        return pending, pending.error

    def _load(self, step: StepMeta) -> _StepLoad:
        pending = _StepLoad(tuple(step.request_ids))
        leases = [Lease(int(lid), int(rank)) for lid, rank in step.leases]
        table = step.table
        try:
            batch: Optional[LoadBatch] = step.load_batch()
        except LoadBatchError as exc:
            self.counters.add("rejected_metadata")
            logger.warning("xavier: rank %d: malformed step metadata: %s", self.rank, exc)
            self._fail(pending, _dests(table), leases, str(exc))
            return pending
        assert batch is not None
        if not self._attached or self.writer is None:
            self._fail(pending, _dests(table), leases, "not attached to the transfer actor")
            return pending
        if self.hooks is not None:
            self.hooks.before_load(batch)
        tiers = batch.table[:, TIER]
        self.counters.add("rows_from_gpu_tier", int((tiers == Tier.GPU).sum()))
        self.counters.add("rows_from_cpu_tier", int((tiers == Tier.CPU).sum()))
        self._follow_world()
        unreachable = self._ensure_mapped({int(r) for r in batch.table[:, RANK]})
        if unreachable:
            drop = np.isin(batch.table[:, RANK], sorted(unreachable))
            self.counters.add("rows_unreachable", int(drop.sum()))
            pending.failed.update(int(x) for x in batch.table[drop, DEST])
            batch = _without_rows(batch, drop)
        if batch is not None and self.hooks is not None:
            batch = self.hooks.apply_faults(batch, pending.failed)
        if batch is None:
            self._releaser.release_many([lease.lease_id for lease in leases])
            return pending
        calls = [(batch, leases)] if self.batched_loads else _per_request(batch, step)
        for part, part_leases in calls:
            try:
                pending.handles.append(self.engine.load_gpu_requests_v1(part, part_leases))
            except Exception as exc:  # refused before any copy; its leases are released
                logger.warning("xavier: rank %d: load of %d blocks refused: %s", self.rank,
                               part.num_rows, exc)
                pending.error = f"{type(exc).__name__}: {exc}"
                pending.failed.update(int(x) for x in part.table[:, DEST])
        return pending

    def _fail(self, pending: _StepLoad, dests: Sequence[int], leases: Sequence[Lease],
              why: str) -> None:
        logger.warning("xavier: rank %d: step loads not done (%s): vLLM recomputes %d blocks",
                       self.rank, why, len(dests))
        pending.error = why
        pending.failed.update(dests)
        self._releaser.release_many([lease.lease_id for lease in leases])

    def finished(self, stream: Optional[torch.cuda.Stream] = None
                 ) -> Tuple[Set[str], Set[int]]:
        """Requests whose loads vLLM may now treat as done, and the blocks among them that
        were not written.  ``stream`` (vLLM's) is ordered after their copies first."""
        done: Set[str] = set()
        failed: Set[int] = set()
        if self.hooks is not None and self.hooks.holding():
            return done, failed
        still: List[_StepLoad] = []
        for p in self._pending:
            if not p.reportable():
                still.append(p)
                continue
            for h in p.handles:
                h.order(stream)
                failed.update(h.failed)
            failed.update(p.failed)
            done.update(p.request_ids)
        self._pending = still
        if failed and self.hooks is not None:
            self.hooks.loaded_failed(failed)
        return done, failed

    def wait_pending(self, timeout: float = 60.0) -> bool:
        """Wait until every launched load can be reported (tests, shutdown)."""
        end = time.monotonic() + timeout
        for p in self._pending:
            for h in p.handles:
                if not h.wait_reportable(max(0.0, end - time.monotonic())):
                    return False
        return True

    # ------------------------------------------------------------------ peers
    def _follow_world(self) -> None:
        """A world update (the actor bumped ``world_epoch``): drop the mappings of every
        rank whose address changed; they are mapped again on next use."""
        epoch = self.counters.get("world_epoch")
        if epoch == self._world_epoch:
            return
        self._world_epoch = epoch
        self.counters.add("world_updates_seen")
        ref = self._transfer.get(timeout=CALL_TIMEOUT_S)
        try:
            world = list(self._bridge.call(lambda: ref.world(), CALL_TIMEOUT_S)) if ref else []
        except Exception as exc:
            logger.warning("xavier: rank %d: reading the new world failed: %r", self.rank, exc)
            world = []
        self.apply_world(world)
        logger.info("xavier: rank %d: world %s", self.rank, world)

    def apply_world(self, world: List[str]) -> None:
        """Take ``world`` as the rank addresses: the mappings of every rank whose address
        changed go (mapped again on next use, without waiting for a retry time)."""
        old, self._world = self._world, list(world)
        for rank in range(max(len(old), len(world))):
            was = old[rank] if rank < len(old) else ""
            now = world[rank] if rank < len(world) else ""
            if rank != self.rank and was != now:
                self._peer_retry_at.pop(rank, None)
                self.engine.unmap_storage(rank)

    def _ensure_mapped(self, ranks: Set[int]) -> Set[int]:
        """Map every rank of ``ranks`` not mapped yet; returns those that cannot be."""
        mapped = {r for r, _ in self.engine.mapped()}
        failed: Set[int] = set()
        for rank in sorted(ranks - mapped):
            if _monotonic() < self._peer_retry_at.get(rank, 0.0):
                failed.add(rank)
                continue
            try:
                self._map_peer(rank)
                self._peer_retry_at.pop(rank, None)
            except Exception as exc:
                self.counters.add("peer_map_failures")
                logger.warning("xavier: rank %d: cannot map rank %d (next try in %.0f s): %r",
                               self.rank, rank, PEER_RETRY_S, exc)
                self._peer_retry_at[rank] = _monotonic() + PEER_RETRY_S
                failed.add(rank)
        return failed

    def _map_peer(self, rank: int) -> None:
        if rank >= len(self._world) or not self._world[rank]:
            raise LookupError(f"rank {rank}: no address known (world {self._world})")
        address, uid = self._world[rank], f"{TRANSFER_ACTOR_UID}-{rank}"
        peer = LazyActor(self._bridge, address, uid)
        ref = peer.get(timeout=PEER_MAP_TIMEOUT_S)
        if ref is None:
            raise LookupError(f"rank {rank}: no transfer actor at {address}")
        desc = self._bridge.call(lambda: ref.storage_descriptor(), PEER_MAP_TIMEOUT_S)
        same_host = desc["host"] == self._host
        transport = self.options.transport
        if same_host and transport != XAVIER_TRANSPORT_NIXL:
            for tier, (kind, handles) in sorted(desc["tiers"].items()):
                caches, release = open_tier(kind, handles, pin=self.device.type == "cuda")
                self.engine.map_storage(rank, Tier(tier), caches, 0, release)
            self.counters.add("peers_mapped_ipc")
            return
        if transport == XAVIER_TRANSPORT_IPC:
            raise LookupError(f"rank {rank} is on another host and the transport is ipc")
        own = self._transfer.get(timeout=CALL_TIMEOUT_S)
        if own is None:
            raise LookupError("the rank's transfer actor is not reachable")
        self._bridge.call(lambda: own.map_remote(rank), PEER_MAP_TIMEOUT_S)
        for tier in sorted(desc["tiers"]):
            self.engine.map_remote_storage(rank, Tier(tier), desc["layout"],
                                           self._remote_fetch(own, rank, Tier(tier)))

    def _remote_fetch(self, own: Any, rank: int, tier: Tier) -> Any:
        """Reads of ``rank``'s ``tier`` through this rank's transfer actor, which receives
        them (NIXL or sockets) into staging rows this process maps too."""
        def fetch(transfer: Any) -> List[torch.Tensor]:
            slots = [int(s) for s in transfer.src_slots]
            group = int(transfer.group)
            self._bridge.call(lambda: own.fetch_blocks(rank, int(tier), group, slots),
                              CALL_TIMEOUT_S)
            return [s[:len(slots)] for s in self._staging[group]]

        return fetch

    # ---------------------------------------------------------------- exports
    def export(self, rows: Sequence[Tuple[int, int, int]]) -> None:
        """Store the step's newly full blocks (vLLM's ``wait_for_save``); never waits."""
        if not rows or self.writer is None:
            return
        self.writer.export(self.engine_views, rows)
        if self.hooks is not None:
            self.hooks.exported(rows)

    def add_step_stats(self, stats: Dict[str, int]) -> None:
        for name, value in stats.items():
            if value:
                self.counters.add(name, value)

    # ------------------------------------------------------------------ close
    def flush(self, timeout: float = 30.0) -> None:
        """Wait for launched loads, pending publications and lease releases (tests)."""
        self.wait_pending(timeout)
        self.engine.drain(timeout)
        if self.writer is not None:
            self.writer.flush(timeout)
        self._releaser.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Let loads and exports in flight finish, unmap every storage (this process lets go
        of peers' CUDA IPC memory before they do), tell the transfer actor that the engine
        goes.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close(timeout)
        except Exception as exc:
            logger.warning("xavier: rank %d: closing the load engine: %r", self.rank, exc)
        if self.writer is not None:
            self.writer.close(timeout)
            self.writer = None
        for release in self._own_releases:
            release()
        self._own_releases.clear()
        self._staging.clear()
        self._releaser.flush(timeout)
        if self._attached:
            self._attached = False
            try:
                ref = self._transfer.get(timeout=5.0)
                if ref is not None:
                    pid = os.getpid()
                    self._bridge.call(lambda: ref.release_engine(pid), 5.0)
            except Exception as exc:
                logger.info("xavier: rank %d: telling the transfer actor: %r", self.rank, exc)
        self.counters.close()


def _dests(table: Any) -> List[int]:
    """Destination block ids of a (possibly malformed) load table; [] when unreadable."""
    try:
        arr = np.asarray(table)
        return sorted({int(x) for x in arr[:, DEST]}) if arr.ndim == 2 and arr.size else []
    except Exception:
        return []


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


def _per_request(batch: LoadBatch, step: StepMeta) -> List[Tuple[LoadBatch, List[Lease]]]:
    """The per-request baseline: one load call per request, each with its own leases."""
    out = []
    for i, part in enumerate(batch.split()):
        lo, hi = step.lease_offsets[i], step.lease_offsets[i + 1]
        out.append((part, [Lease(int(lid), int(rank)) for lid, rank in step.leases[lo:hi]]))
    return out
