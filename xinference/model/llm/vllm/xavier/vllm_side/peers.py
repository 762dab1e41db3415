"""The peers one worker reads, and how: mapped on this host, through the actor otherwise.

:class:`PeerMaps` keeps the world (every rank's address) as the rank's transfer actor
last told it and maps every peer before a load needs it, on a thread of its own
(:meth:`PeerMaps.start`; CUDA IPC and shared memory on this host, the peer's CPU tier
page-locked here too: :func:`~..planning.routes.peer_route`), so that no hit pays for
it.  No load waits for a peer of another host or for the mapping thread
(:meth:`PeerMaps.ensure_mapped`; until session 27 loads mapped every peer on vLLM's step
thread, and with a peer's host dark every step waited up to ~25 s): the rows of a peer
that cannot be read now fail (vLLM recomputes them; so do those of a peer whose reads
failed lately: :mod:`.remote_reads`) and the mapping thread maps it next
-- a peer of another host (read through the rank's actor: NIXL or sockets, into staging
rows this process maps too) once a load asked for it.  A peer that a load asked for and
that could not be mapped is not tried again for :data:`PEER_RETRY_S`, doubling to
:data:`PEER_RETRY_MAX_S`; a world update that changes its address ends the wait.  The
mapping thread's own failures (a peer still starting) only delay its next try
(:data:`PREMAP_RETRY_S`).  A peer without storage (the launch's rank-0 coordinator) is
not asked again until the world changes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Dict, List, Optional, Set

from ..mechanism.gpu_transfer import GPUTransfer
from ..mechanism.in_place import CacheHandles, open_caches
from ..mechanism.kv_schema import KVLayout
from ..mechanism.nixl_endpoint import endpoint_host
from ..mechanism.slot_generations import SlotGenerations
from ..mechanism.snapshot_storage import open_tier
from ..planning.counters import SharedCounters
from ..planning.load_batch import Tier
from ..planning.log_names import package_logger
from ..planning.options import XavierOptions, transfer_actor_uid
from ..planning.rank_backoff import RankBackoff
from ..planning.routes import ROUTE_IPC, peer_route
from .actor_bridge import ActorBridge, LazyActor
from .remote_reads import RemoteReads

logger = package_logger(__name__)

#: longest an actor call for a peer may take (world, remote fetch)
CALL_TIMEOUT_S = 30.0
#: a peer that could not be mapped is not tried again for this long
PEER_RETRY_S = 5.0
PEER_RETRY_MAX_S = 60.0
PEER_MAP_TIMEOUT_S = 10.0
#: how often the mapping thread looks for a world update or an unmapped peer
PREMAP_PERIOD_S = 0.5
#: a peer the mapping thread could not map is tried again by it after this long
PREMAP_RETRY_S = 2.0
_monotonic = time.monotonic  # the peer-retry clock (tests move it)


class PeerMaps:
    """The mapped peers of one worker's load engine (see the module docstring)."""

    def __init__(self, rank: int, options: XavierOptions, bridge: ActorBridge,
                 transfer: LazyActor, engine: GPUTransfer, counters: SharedCounters,
                 pin: bool, tp_rank: int = 0, layout: Optional[KVLayout] = None) -> None:
        self._rank, self._options, self._bridge = rank, options, bridge
        #: the TP worker this is (it reads shard ``tp_rank`` of every peer) and its KV
        #: layout (a peer's must match it, TP degree included)
        self._tp_rank, self._layout = tp_rank, layout
        self._transfer, self._engine, self._counters = transfer, engine, counters
        self._pin, self._world_epoch = pin, 0
        self._world: List[str] = []
        #: no try of these peers before these times (one a load asked for failed; the
        #: mapping thread's own pass failed)
        self._peer_backoff = RankBackoff(PEER_RETRY_S, PEER_RETRY_MAX_S, lambda: _monotonic())
        self._premap_retry_at: Dict[int, float] = {}
        self._storageless: Set[int] = set()  # hold no storage (until the world changes)
        #: reads of other hosts' storages, and the peers they keep out for a while
        self.reads = RemoteReads(rank, tp_rank, bridge, counters)
        self._host = ""
        #: held while the world or a mapping changes (the step's thread and the mapper)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._mapper: Optional[threading.Thread] = None
        #: peers found to be on another host (not premapped; forgotten when they move)
        self._remote: Set[int] = set()
        #: peers whose tiers are being mapped (a load waits for all of them)
        self._in_progress: Set[int] = set()
        #: what loads ask of the mapping thread (under ``_asks``, never held while a peer is
        #: called): peers to map again (a load named a tier they published after their
        #: mapping), peers a load could not read (mapped next, of another host too)
        self._asks, self._wake = threading.Lock(), threading.Event()
        self._refresh: Set[int] = set()
        self._wanted: Set[int] = set()

    def opened(self, desc: Dict[str, Any]) -> None:
        """The rank's own storage was opened from the actor's descriptor ``desc``: its host,
        world and staging rows."""
        self.reads.opened(desc["staging"])
        self._host = str(desc["host"])
        self._world = list(desc.get("world") or [])
        self._world_epoch = self._counters.get("world_epoch")

    def start(self) -> None:
        """Start the mapping thread (once): every :data:`PREMAP_PERIOD_S` it follows the
        world and maps the peers not mapped yet, off the step's path."""
        if self._mapper is None and not self._stop.is_set():
            self._mapper = threading.Thread(target=self._premap_loop, daemon=True,
                                            name=f"xavier-peer-maps-{self._rank}")
            self._mapper.start()

    def _premap_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.premap()
            except Exception as exc:  # loads fail fast meanwhile; try again later
                logger.warning("xavier: rank %d: mapping peers: %r", self._rank, exc)
            self._wake.wait(PREMAP_PERIOD_S)
            self._wake.clear()

    def premap(self) -> Set[int]:
        """Follow the world and map every peer of THIS host not mapped yet (the mapping
        thread; tests call it directly); returns the peers that could not be mapped.
        A peer of another host is left to its first load (a remote route is set up by
        the rank's actor: nothing to gain here, and a dead host would be retried).  A
        peer's descriptor is asked for without holding the lock that loads take, so a
        slow or dead peer never holds a step up."""
        for rank in self._engine.take_stale_ranks():  # mapped again below
            self._counters.add("stale_mappings_dropped")
            logger.info("xavier: rank %d: rank %d's mapped storage is gone (a load found "
                        "it): mapping it again", self._rank, rank)
            self._engine.unmap_storage(rank)  # not under the lock: it may wait for loads
        with self._asks:
            refresh, self._refresh = self._refresh, set()
            wanted, self._wanted = self._wanted, set()
        for rank in refresh:
            self._engine.unmap_storage(rank)
        with self._lock:
            if self._stop.is_set():
                return set()
            self.follow_world()
            mapped = {r for r, _ in self._engine.mapped()}
            now = _monotonic()
            due = {r: a for r, a in enumerate(self._world)
                   if a and r != self._rank and r not in mapped
                   and (r not in self._remote or r in wanted) and r not in self._storageless
                   and not self._peer_backoff.waiting(r, now)
                   and (r in wanted or now >= self._premap_retry_at.get(r, 0.0))}
        failed: Set[int] = set()
        # this host's peers first: a dark host of another one must not delay them
        for rank, address in sorted(due.items(), key=lambda x: (x[0] in self._remote, x[0])):
            t0 = time.perf_counter()
            ahead = rank not in wanted  # (a load asked: a failure keeps loads off it a while)
            try:
                desc = self._describe(rank, address)
            except Exception as exc:  # e.g. a peer still starting: loads fail fast meanwhile
                with self._lock:
                    (self._premap_failed if ahead else self._failed_to_map)(rank, exc)
                failed.add(rank)
                continue
            with self._lock:
                if self._stop.is_set():
                    break
                current = self._world[rank] if rank < len(self._world) else ""
                if current != address or rank in {r for r, _ in self._engine.mapped()}:
                    continue  # the world moved or a load mapped it meanwhile
                if desc is None:
                    self._storageless.add(rank)
                elif not self._try_map(rank, t0, desc, ahead=ahead):
                    failed.add(rank)
        return failed

    def _premap_failed(self, rank: int, exc: BaseException) -> None:
        """The mapping thread could not map ``rank`` ahead (lock held): next try later."""
        self._counters.add("peer_premap_failures")
        logger.info("xavier: rank %d: rank %d not mapped ahead (next try in %.0f s): %r",
                    self._rank, rank, PREMAP_RETRY_S, exc)
        self._premap_retry_at[rank] = _monotonic() + PREMAP_RETRY_S

    def stop(self) -> None:
        """Stop the mapping thread (first thing when the plane closes).  Idempotent."""
        self._stop.set()
        self._wake.set()
        mapper, self._mapper = self._mapper, None
        if mapper is not None and mapper is not threading.current_thread():
            mapper.join(PEER_MAP_TIMEOUT_S * 2)

    def close(self) -> None:
        """Stop the mapping thread, drop the staging rows (the engine unmaps the peers
        when it closes).  Idempotent."""
        self.stop()
        with self._lock:
            self.reads.close()

    def follow_world(self) -> None:
        """A world update (the actor bumped ``world_epoch``): drop the mappings of every
        rank whose address changed; they are mapped again on next use."""
        epoch = self._counters.get("world_epoch")
        if epoch == self._world_epoch:
            return
        with self._lock:
            if epoch != self._world_epoch:
                self._follow_world(epoch)

    def _follow_world(self, epoch: int) -> None:
        self._counters.add("world_updates_seen")
        ref = self._transfer.get(timeout=CALL_TIMEOUT_S)
        try:
            world = list(self._bridge.call(lambda: ref.world(), CALL_TIMEOUT_S)) if ref else []
        except Exception as exc:
            logger.warning("xavier: rank %d: reading the new world failed: %r", self._rank, exc)
            world = []
        self.apply_world(world)
        self._world_epoch = epoch  # (loads trust the mappings again)
        logger.info("xavier: rank %d: world %s", self._rank, world)

    def apply_world(self, world: List[str]) -> None:
        """Take ``world`` as the rank addresses: the mappings of every rank whose address
        changed go (mapped again on next use, without waiting for a retry time)."""
        with self._lock:
            self._apply_world(world)

    def _apply_world(self, world: List[str]) -> None:
        old, self._world = self._world, list(world)
        for rank in range(max(len(old), len(world))):
            was = old[rank] if rank < len(old) else ""
            now = world[rank] if rank < len(world) else ""
            if rank != self._rank and was != now:
                self._peer_backoff.forget(rank)
                self._premap_retry_at.pop(rank, None)
                self._storageless.discard(rank)
                self._remote.discard(rank)
                self.reads.forget(rank)
                self.reads.abandon(rank)  # (its reads waiting now: the peer is gone)
                self._engine.unmap_storage(rank)

    def ensure_mapped(self, ranks: Set[int]) -> Set[int]:
        """The ranks of ``ranks`` a load cannot read now (vLLM's step thread: it never waits
        for a peer of another host, see the module docstring).  A peer not mapped yet whose
        address names this rank's host and that did not fail lately is mapped here (after
        the mapping thread's work on this host, which holds the lock; a remote setup never
        holds it)."""
        self.follow_world()  # (asks this rank's own actor, never a peer)
        missing = (ranks - {r for r, _ in self._engine.mapped()}) | (ranks & self._in_progress)
        kept_out = self.reads.kept_out(ranks - missing)  # (their reads failed lately)
        if not missing:
            return kept_out
        now = _monotonic()
        here = [r for r in sorted(missing)
                if r not in self._remote and self._same_address_host(r)
                and not self._peer_backoff.waiting(r, now)]
        if here and self._lock.acquire(timeout=PEER_MAP_TIMEOUT_S):  # (this host's work only)
            try:
                for rank in here:  # (one of another host: found so, and left to the thread)
                    self._try_map(rank, time.perf_counter(), remote=False)
            finally:
                self._lock.release()
            missing -= {r for r, _ in self._engine.mapped()}
        if missing:
            with self._asks:
                self._wanted |= missing
            self._wake.set()
        return missing | kept_out

    def _same_address_host(self, rank: int) -> bool:
        """Whether ``rank``'s address names the host part of this rank's own (then the
        step's thread may ask for its descriptor; any other peer is described by the
        mapping thread only: a first describe of another host's peer took 17 s under
        load in CI, on vLLM's step thread).  Conservative: a peer of this host bound to
        another address is only mapped a little later, by the thread."""
        world = self._world
        if not (rank < len(world) and self._rank < len(world)):
            return False
        own, peer = world[self._rank], world[rank]
        try:
            return bool(own and peer) and endpoint_host(own) == endpoint_host(peer)
        except ValueError:
            return False

    def _try_map(self, rank: int, t0: float, desc: Optional[Dict[str, Any]] = None,
                 ahead: bool = False, remote: Optional[bool] = None) -> bool:
        """Map ``rank`` (lock held) from ``desc`` (asked for when None), counting the time
        or the failure; False if it failed.  For a load: a failure keeps loads off the
        peer for :data:`PEER_RETRY_S`.  ``ahead`` (the mapping thread): a peer of another
        host is left to its first load, and a failure only delays the thread's next try."""
        try:
            if self._map_peer(rank, not ahead if remote is None else remote, desc):
                self._counters.add("peer_map_us", int(1e6 * (time.perf_counter() - t0)))
            self._premap_retry_at.pop(rank, None)
            self._peer_backoff.forget(rank)
            return True
        except Exception as exc:
            (self._premap_failed if ahead else self._failed_to_map)(rank, exc)
            return False

    def _failed_to_map(self, rank: int, exc: BaseException) -> None:
        """A peer a load asked for could not be mapped: not tried again for
        :data:`PEER_RETRY_S`, doubled with each failure in a row up to
        :data:`PEER_RETRY_MAX_S` (a dark host costs the mapping thread one timeout a
        minute, not one every few seconds)."""
        self._counters.add("peer_map_failures")
        wait = self._peer_backoff.failed(rank)
        logger.warning("xavier: rank %d: cannot map rank %d (next try in %.0f s): %r",
                       self._rank, rank, wait, exc)

    def _describe(self, rank: int, address: str) -> Optional[Dict[str, Any]]:
        """``rank``'s storage descriptor, from its transfer actor at ``address`` (a call to
        another process; no lock needed); None for a rank that holds no storage."""
        peer = LazyActor(self._bridge, address, transfer_actor_uid(rank))
        ref = peer.get(timeout=PEER_MAP_TIMEOUT_S)
        if ref is None:
            raise LookupError(f"rank {rank}: no transfer actor at {address}")
        tp_rank = self._tp_rank
        desc: Optional[Dict[str, Any]] = self._bridge.call(
            lambda: ref.storage_descriptor(tp_rank), PEER_MAP_TIMEOUT_S)
        return desc

    def _map_peer(self, rank: int, remote: bool = True,
                  desc: Optional[Dict[str, Any]] = None) -> bool:
        """Map ``rank`` from its descriptor ``desc`` (asked for when None): CUDA IPC /
        shared memory on this host, through the rank's actor otherwise unless not
        ``remote``; returns whether it was mapped."""
        if rank >= len(self._world) or not self._world[rank]:
            raise LookupError(f"rank {rank}: no address known (world {self._world})")
        if desc is None:
            desc = self._describe(rank, self._world[rank])
            if desc is None:
                raise LookupError(f"rank {rank}: holds no storage")
        layout: KVLayout = desc["layout"]
        if self._layout is not None:  # the TP degree: the engine sees one shard's caches
            self._layout.check_compatible(layout, f"rank {rank}")
        shard_layout = dataclasses.replace(layout, tp_size=1)
        try:
            # NIXL vs sockets is the actor's choice (map_remote): only "ipc or not" here
            route = peer_route(self._options.transport, desc["host"] == self._host, True)
        except LookupError as exc:
            raise LookupError(f"rank {rank}: {exc}") from None
        in_place: Optional[CacheHandles] = desc.get("in_place")
        if route == ROUTE_IPC:
            self._in_progress.add(rank)  # one tier mapped is not the peer mapped
            gens: Optional[SlotGenerations] = None
            try:
                tiers = sorted(desc["tiers"].items())
                gens = SlotGenerations.open(desc["generations"])  # what reads are checked on
                releases = _closing_after_all(gens, len(tiers))
                for (tier, (kind, handles)), done in zip(tiers, releases):
                    caches, release = open_tier(kind, handles, pin=self._pin)
                    self._engine.map_storage(rank, Tier(tier), caches, 0, done(release), gens)
                if in_place is not None:  # the peer's own vLLM cache, read in place
                    try:
                        self._map_in_place(rank, in_place)
                    except Exception as exc:  # its other tiers stay mapped; those reads miss
                        self._counters.add("peer_map_failures")
                        logger.warning("xavier: rank %d: rank %d's vLLM cache not mapped: %r",
                                       self._rank, rank, exc)
            except BaseException:
                self._engine.unmap_storage(rank)  # whole or not at all
                if gens is not None:
                    gens.close()
                raise
            finally:
                self._in_progress.discard(rank)
            self._counters.add("peers_mapped_ipc")
            return True
        if not remote and desc["host"] != self._host:  # (this host's, NIXL forced: mapped)
            self._remote.add(rank)
            return False
        own = self._transfer.get(timeout=CALL_TIMEOUT_S)
        if own is None:
            raise LookupError("the rank's transfer actor is not reachable")
        self._lock.release()  # (the mapping thread's: a dark host holds up no load here)
        try:
            self._bridge.call(lambda: own.map_remote(rank), PEER_MAP_TIMEOUT_S)
        finally:
            self._lock.acquire()
        tiers = [Tier(t) for t in sorted(desc["tiers"])] + ([Tier.VLLM] if in_place else [])
        for tier in tiers:
            self._engine.map_remote_storage(rank, tier, shard_layout,
                                           self.reads.reader(own, rank, tier))
        return True

    def _map_in_place(self, rank: int, handles: CacheHandles) -> None:
        """Map ``rank``'s vLLM KV cache (this host) as its ``Tier.VLLM``, its reads checked
        against the engine's block generations."""
        gens = SlotGenerations.open(handles.generations)
        try:
            caches, release = open_caches(handles, pin=self._pin)
        except BaseException:
            gens.close()
            raise

        def let_go() -> None:
            try:
                release()
            finally:
                gens.close()

        try:
            self._engine.map_storage(rank, Tier.VLLM, caches, handles.block_dims, let_go, gens)
        except BaseException:
            let_go()
            raise

    def refresh(self, rank: int) -> None:
        """A load found a tier of ``rank`` unmapped (published after the peer was mapped
        here): the mapping thread maps the peer again."""
        with self._asks:
            self._refresh.add(rank)
        self._wake.set()


def _closing_after_all(gens: SlotGenerations, tiers: int) -> List[Any]:
    """Per tier, a wrapper of its release that also unmaps ``gens`` once every tier of the
    peer was released (the tiers share one generations file)."""
    left = [tiers]
    lock = threading.Lock()  # two tiers may be let go on two threads

    def wrap(release: Optional[Any]) -> Any:
        def done() -> None:
            try:
                if release is not None:
                    release()
            finally:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    gens.close()
        return done

    return [wrap] * tiers
