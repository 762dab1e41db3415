"""Rank registry and rank 0 of Xinference's Xavier contract (supervisor / worker pools).

Imported by Xinference's supervisor at every start: xoscar only, no torch, no vLLM.

* :class:`CollectiveManager` (supervisor pool, uid ``f"{default_uid()}-{model_uid}"``):
  knows every rank's transfer actor; on recovery (``register_rank(..., update=True)``) and
  on ``unregister_rank`` it sends the new world (rank -> address) to every rank, which then
  maps its peers again on first use.  Ranks that cannot be reached are logged, not fatal: a
  rank that misses an update only misses hits (its loads from an unmapped peer fail and
  vLLM recomputes).  It also checks every few seconds that each rank still answers: a rank
  whose worker or host died or went dark (Xinference tells Xavier nothing then) is
  unregistered once it has answered none of :attr:`CollectiveManager.LIVENESS_MISSES`
  checks in a row, so its blocks leave the directory and the other ranks stop trying to
  read them; one that answers again later (it was stalled, not dead) is taken back.
* :class:`Rank0ModelActor` (worker, GPU-less subpool, uid ``"<model_uid>-rank0"``): rank 0
  holds no engine; its :class:`Rank0TransferActor` only answers the world updates so that
  the manager can treat all ranks alike.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import xoscar as xo

from .planning.log_names import package_logger
from .planning.options import TRANSFER_ACTOR_UID, transfer_actor_uid

logger = package_logger(__name__)


class Rank0TransferActor(xo.StatelessActor):
    """Rank 0's stand-in transfer actor: no engine, no storage."""

    @classmethod
    def default_uid(cls) -> str:
        return TRANSFER_ACTOR_UID

    def __init__(self, rank: int = 0, world_size: int = 0, rank_address: str = "",
                 store_address: str = "", store_port: int = 0,
                 world_addresses: Optional[List[str]] = None) -> None:
        super().__init__()
        self.rank = rank
        self.world_addresses = list(world_addresses or [])

    def update_world(self, world_addresses: List[str]) -> None:
        self.world_addresses = list(world_addresses)

    def world(self) -> List[str]:
        """The rank addresses this rank was last told."""
        return list(self.world_addresses)

    def is_ready(self) -> bool:
        return False

    def storage_descriptor(self, tp_rank: int = 0) -> None:
        """Rank 0 holds no storage: peers have nothing to map here."""
        return None

    def counters(self) -> Dict[str, int]:
        return {}


class Rank0ModelActor(xo.StatelessActor):
    """Rank 0: a thin coordinator in a GPU-less subpool (uid ``"<model_uid>-rank0"``)."""

    @classmethod
    def default_uid(cls) -> str:
        return "rank0-model-actor"

    def __init__(self, xavier_config: Dict[str, Any]) -> None:
        super().__init__()
        self._rank = 0
        self._xavier_config = dict(xavier_config)
        self._transfer_ref: Any = None

    async def start_transfer_for_vllm(self, rank_addresses: List[str]) -> None:
        if self._transfer_ref is not None:
            await self._transfer_ref.update_world(list(rank_addresses))
            return
        self._transfer_ref = await xo.create_actor(
            Rank0TransferActor, address=self.address, uid=transfer_actor_uid(self._rank),
            rank=self._rank, world_size=self._xavier_config.get("world_size") or 0,
            rank_address=self._xavier_config.get("rank_address") or self.address,
            store_address=self._xavier_config.get("store_address") or "",
            store_port=self._xavier_config.get("store_port") or 0,
            world_addresses=list(rank_addresses))
        logger.info("xavier rank 0 at %s: world %s", self.address, rank_addresses)

    def get_pool_addresses(self) -> Optional[List[str]]:
        """Rank 0 creates no pools of its own (Xinference asks before terminating)."""
        return None

    async def stop(self) -> None:
        await self._destroy_transfer()

    async def __pre_destroy__(self) -> None:
        await self._destroy_transfer()

    async def _destroy_transfer(self) -> None:
        ref, self._transfer_ref = self._transfer_ref, None
        if ref is not None:
            try:
                await xo.destroy_actor(ref)
            except Exception as exc:  # its pool may be gone already
                logger.debug("xavier rank 0: destroying the transfer actor: %s", exc)


class CollectiveManager(xo.StatelessActor):
    """Rank registry of one Xavier model (uid ``f"{default_uid()}-{model_uid}"``)."""

    #: seconds between the starts of two liveness checks of every rank (a fixed cadence)
    LIVENESS_INTERVAL_S = 5.0
    #: seconds after a check's start at which its verdict is taken
    LIVENESS_TIMEOUT_S = 1.0
    #: checks in a row a rank answered none of before it counts as dead and is unregistered
    LIVENESS_MISSES = 2
    #: seconds a rank dropped as unreachable is still asked (one that answers is taken back)
    READMIT_WINDOW_S = 600.0

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-collective-manager"

    def __init__(self, model_uid: str, liveness_interval_s: Optional[float] = None,
                 liveness_timeout_s: Optional[float] = None) -> None:
        """``liveness_interval_s``: seconds between the starts of two checks (default
        :attr:`LIVENESS_INTERVAL_S`); ``liveness_timeout_s``: seconds after a check's start
        at which it is judged (default :attr:`LIVENESS_TIMEOUT_S`).  A late answer still
        counts: a rank is dropped only when it answered nothing since the start of the
        check before (silent for an interval plus the timeout), so a dark host leaves within
        ``(LIVENESS_MISSES - 1) * interval + timeout`` of its next check, at most
        ``LIVENESS_MISSES * interval + timeout`` after it went dark, while a slow but live
        rank is never dropped.  No verdict is taken while no rank at all answered since the
        round judged began (this side stalled, not the ranks).  A world update may take
        ``max(interval, timeout)``."""
        super().__init__()
        self._model_uid = model_uid
        self._addresses: Dict[int, str] = {}
        self._refs: Dict[int, Any] = {}
        #: bumped at every registration: a liveness verdict only applies to the
        #: registration it checked (a rank recovered meanwhile is not dropped)
        self._generation: Dict[int, int] = {}
        self._tracker: Any = None
        self._lock = asyncio.Lock()
        self._interval = float(liveness_interval_s or self.LIVENESS_INTERVAL_S)
        self._timeout = float(liveness_timeout_s or self.LIVENESS_TIMEOUT_S)
        self._update_timeout = max(self._interval, self._timeout)
        #: (rank, generation) -> when it last answered a check (or registered), monotonic
        self._answered: Dict[Tuple[int, int], float] = {}
        #: (rank, generation) -> its check in flight (one at a time per rank)
        self._asking: Dict[Tuple[int, int], asyncio.Task] = {}
        #: when any rank last answered a check (monotonic): no verdict is taken while none
        #: did since the round judged began (the manager's own process or network stalled:
        #: e.g. xoscar's connect to a dark address holds every call of this process ~8 s)
        self._heard_any = time.monotonic()
        self._watch: Optional[asyncio.Task] = None
        self.world_updates = 0
        self.ranks_dropped_unreachable = 0
        #: rank -> its registration generation, for ranks whose last world update failed
        #: or timed out: sent the world again once they answer a liveness check
        self._behind: Dict[int, int] = {}
        self.world_updates_retried = 0
        #: rank -> (generation, address, when) of ranks dropped as unreachable: still asked,
        #: taken back when one answers (a live rank left out of the world publishes blocks
        #: no peer can read: offered hits that fail); the ask in flight
        self._dropped: Dict[int, Tuple[int, str, float]] = {}
        self._probing: Optional[asyncio.Task] = None
        self.ranks_readmitted = 0

    async def __post_create__(self) -> None:
        from .block_tracker import VLLMBlockTracker

        try:
            self._tracker = await xo.actor_ref(
                address=self.address, uid=f"{VLLMBlockTracker.default_uid()}-{self._model_uid}")
        except Exception as exc:  # created first in a test, or the tracker lives elsewhere
            logger.warning("xavier collective manager %s: no block tracker: %s",
                           self._model_uid, exc)
        self._watch = asyncio.create_task(self._watch_ranks())

    async def register_rank(self, rank: int, address: str, update: bool = False) -> None:
        """Record ``rank``'s transfer actor at ``address``; with ``update`` (recovery) send
        the new world to every rank."""
        ref = await xo.actor_ref(address=address, uid=transfer_actor_uid(rank))
        async with self._lock:
            self._dropped.pop(rank, None)  # (Xinference's recovery: the new one counts)
            self._refs[rank] = ref
            self._addresses[rank] = address
            self._generation[rank] = self._generation.get(rank, 0) + 1
            self._answered[(rank, self._generation[rank])] = time.monotonic()
        logger.info("xavier %s: rank %d registered at %s%s", self._model_uid, rank, address,
                    " (world update)" if update else "")
        if update:
            await self._update_world()

    async def unregister_rank(self, rank: int) -> None:
        """Forget ``rank`` (it died): its blocks leave the directory, the others stop
        reading from it."""
        await self._forget(rank, None)

    async def _forget(self, rank: int, generation: Optional[int],
                      update: bool = True) -> bool:
        """Forget ``rank`` (only its registration ``generation`` when given, which means the
        rank was found unreachable: a rank that registered again meanwhile stays); False when
        nothing was forgotten.  ``update``: send the new world to the others now."""
        async with self._lock:
            if generation is not None and (self._generation.get(rank) != generation
                                           or rank not in self._refs):
                return False
            self._refs.pop(rank, None)
            address = self._addresses.pop(rank, "")
            self._behind.pop(rank, None)
            self._dropped.pop(rank, None)
            if generation is not None:
                # counted with the removal, so that liveness() never shows the rank gone
                # and the count not yet raised (it answers while the directory is told)
                self.ranks_dropped_unreachable += 1
                self._dropped[rank] = (generation, address, time.monotonic())
        if self._tracker is not None:
            dropped = await self._tracker.unregister_rank(rank)
            logger.info("xavier %s: rank %d unregistered (%s blocks dropped)", self._model_uid,
                        rank, dropped)
        if update:
            await self._update_world()
        return True

    async def __pre_destroy__(self) -> None:
        for task in (self._watch, self._probing):
            if task is not None:
                task.cancel()
        self._watch = self._probing = None
        for task in list(self._asking.values()):
            task.cancel()

    async def _watch_ranks(self) -> None:
        """Every interval (a fixed cadence: a hung check never delays the next round), ask
        every registered rank whether it is there; judge the round its timeout later."""
        starts: Deque[float] = collections.deque(maxlen=self.LIVENESS_MISSES)
        while True:
            await asyncio.sleep(self._interval - self._timeout if self._interval >
                                self._timeout else self._interval)
            starts.append(time.monotonic())
            try:
                checked = await self._start_checks()
                await asyncio.sleep(self._timeout)
                if len(starts) == self.LIVENESS_MISSES:
                    await self._judge(checked, starts[0])
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the watch itself is stopped
                logger.warning("xavier %s: rank liveness check cancelled: %r",
                               self._model_uid, exc)  # (a call cancelled on its other side)
            except Exception as exc:  # the watch outlives one bad round
                logger.warning("xavier %s: rank liveness check failed: %r", self._model_uid,
                               exc)

    async def _start_checks(self) -> List[Tuple[int, int, Any]]:
        """Ask every rank that has no check in flight; the ranks registered now."""
        async with self._lock:
            checked = [(rank, self._generation.get(rank, 0), ref)
                       for rank, ref in self._refs.items()]
            for rank, (_, _, at) in list(self._dropped.items()):
                if time.monotonic() - at > self.READMIT_WINDOW_S:
                    del self._dropped[rank]  # (dead: a recovery registers it anew)
            if self._dropped and (self._probing is None or self._probing.done()):
                self._probing = asyncio.create_task(self._probe_dropped(dict(self._dropped)))
        current = {(rank, generation) for rank, generation, _ in checked}
        for stale in [key for key in self._answered if key not in current]:
            del self._answered[stale]  # unregistered or registered again meanwhile
            task = self._asking.pop(stale, None)
            if task is not None:
                task.cancel()
        for rank, generation, ref in checked:
            key = (rank, generation)
            if key not in self._asking:
                self._asking[key] = asyncio.create_task(self._ask(key, ref))
        return checked

    async def _probe_dropped(self, dropped: Dict[int, Tuple[int, str, float]]) -> None:
        """Ask the dropped ranks for their world, on a thread's own event loop (xoscar's
        connect to a dark host holds every call of the loop it runs on for ~8 s: never this
        actor's); take back, as new registrations, those that answer with this launch's
        world (not an actor of another launch at a reused address), and send the world to
        every rank.  The blocks they publish from now on are offered again."""
        timeout = self._interval + self._timeout

        async def ask(rank: int, address: str) -> List[str]:
            ref = await xo.actor_ref(address=address, uid=transfer_actor_uid(rank))
            return list(await asyncio.wait_for(ref.world(), timeout))

        async def ask_all() -> List[Any]:
            return await _within(timeout, [ask(r, a) for r, (_, a, _) in dropped.items()])

        worlds = await asyncio.to_thread(asyncio.run, ask_all())
        back = []
        async with self._lock:
            ours = self.world()
            for (rank, (generation, address, at)), theirs in zip(dropped.items(), worlds):
                if (self._dropped.get(rank) != (generation, address, at) or rank in self._refs
                        or not _same_launch(theirs, rank, address, ours)):
                    continue
                del self._dropped[rank]
                self._refs[rank] = xo.create_actor_ref(address, transfer_actor_uid(rank))
                self._addresses[rank] = address
                self._generation[rank] = self._generation.get(rank, 0) + 1  # (judged
                self._answered[(rank, self._generation[rank])] = time.monotonic()  # anew)
                self.ranks_readmitted += 1
                back.append(rank)
                logger.warning("xavier %s: rank %d at %s answers again after it was dropped "
                               "as unreachable: taken back", self._model_uid, rank, address)
        if back:
            await self._update_world()

    async def _ask(self, key: Tuple[int, int], ref: Any) -> None:
        """One check: an answer (any value) is recorded when it comes, however late; a
        check is given up after an interval plus the timeout (its rank has been judged by
        then), an error (refused connection, no such actor) is no answer."""
        try:
            await asyncio.wait_for(ref.is_ready(), self._interval + self._timeout)
        except Exception as exc:
            logger.debug("xavier %s: rank %d did not answer a liveness check: %r",
                         self._model_uid, key[0], exc)
        else:
            self._heard_any = time.monotonic()
            if key in self._answered:
                self._answered[key] = self._heard_any
        finally:
            self._asking.pop(key, None)

    async def _judge(self, checked: List[Tuple[int, int, Any]], since: float) -> None:
        """Drop the ranks that answered nothing since ``since`` (the start of the first of
        the last :attr:`LIVENESS_MISSES` rounds); send the world again to those that answer
        while their last update failed."""
        if self._heard_any < since:
            return  # nobody answered since: this side is cut off, the ranks may be fine
        retry, dropped = [], 0
        try:
            for rank, generation, ref in checked:
                key = (rank, generation)
                answered = self._answered.get(key)
                if answered is None:
                    continue  # gone meanwhile
                if answered < since:
                    # every silent rank first, then ONE world update (a host gone dark
                    # takes all its ranks at once: no drop waits on an update to another)
                    dropped += await self._drop_unreachable(rank, generation,
                                                            time.monotonic() - answered)
                elif self._behind.get(rank) == generation and key not in self._asking:
                    retry.append((rank, generation, ref))
        finally:
            if dropped:  # (also when a later drop failed: the survivors must hear of it)
                await self._update_world()
        if retry:
            await self._send_world(retry, retried=True)

    async def _drop_unreachable(self, rank: int, generation: int, silent_s: float) -> bool:
        address = self._addresses.get(rank, "")
        if not await self._forget(rank, generation, update=False):
            return False
        logger.warning("xavier %s: rank %d at %s answered none of %d liveness checks in a row "
                       "(silent for %.1f s): unregistered", self._model_uid, rank, address,
                       self.LIVENESS_MISSES, silent_s)
        return True

    def liveness(self) -> Dict[str, Any]:
        """The ranks watched now, how many were dropped as unreachable, the ranks whose last
        world update failed (``behind``) and how many updates were sent again."""
        return {"ranks": sorted(self._refs), "dropped_unreachable":
                self.ranks_dropped_unreachable, "readmitted": self.ranks_readmitted,
                "interval_s": self._interval,
                "behind": sorted(self._behind), "world_updates_retried":
                self.world_updates_retried}

    def world(self) -> List[str]:
        """Rank addresses by rank ("" where a rank is missing)."""
        if not self._addresses:
            return []
        return [self._addresses.get(r, "") for r in range(max(self._addresses) + 1)]

    async def _update_world(self) -> None:
        """Send the world to every rank, each allowed ``max(interval, timeout)``: a rank that does
        not answer in time (a dark host) neither holds the others' update nor the
        registrations behind this lock for longer; it gets the world again once it answers a
        liveness check (:attr:`world_updates_retried`)."""
        await self._send_world(None)

    async def _send_world(self, ranks: Optional[List[Tuple[int, int, Any]]],
                          retried: bool = False) -> None:
        """The world to ``ranks`` (``(rank, generation, ref)``; None: every rank now)."""
        async with self._lock:  # two recoveries at once must not interleave their updates
            world = self.world()
            if ranks is None:
                ranks = [(rank, self._generation.get(rank, 0), ref)
                         for rank, ref in self._refs.items()]
            else:  # (only registrations still current: a rank registered again meanwhile
                # got the world with its registration's update)
                ranks = [(rank, generation, ref) for rank, generation, ref in ranks
                         if rank in self._refs and self._generation.get(rank) == generation]
            results = await _within(self._update_timeout,
                                    [ref.update_world(world) for _, _, ref in ranks])
            self.world_updates += 1
            self.world_updates_retried += len(ranks) if retried else 0
            for (rank, generation, _), res in zip(ranks, results):
                if not isinstance(res, BaseException):
                    if self._behind.get(rank) == generation:
                        del self._behind[rank]
                    continue
                if self._generation.get(rank) == generation:
                    self._behind[rank] = generation
                logger.warning("xavier %s: world update to rank %d failed (%s): sent again "
                               "once it answers a liveness check", self._model_uid, rank,
                               res if str(res) else type(res).__name__)


async def _within(timeout: float, calls: List[Any]) -> List[Any]:
    """Run ``calls`` at once: each one's result, exception, or ``TimeoutError`` after
    ``timeout`` s.  Unlike ``asyncio.wait_for``, never waits for a call to take its
    cancellation (xoscar's connect to a dark host does not: a 5 s bound held 20 s)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()  # not awaited; its late end is retrieved (no "never retrieved" log)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return [TimeoutError(f"no answer within {timeout:g} s") if task in pending
            else asyncio.CancelledError("cancelled on the other side") if task.cancelled()
            else (task.exception() or task.result()) for task in tasks]


def _same_launch(theirs: Any, rank: int, address: str, ours: List[str]) -> bool:
    """Whether ``theirs`` (the world a dropped rank answered with) is this launch's: its own
    address at its rank, and the address of at least one other rank registered now."""
    if not (isinstance(theirs, list) and rank < len(theirs) and theirs[rank] == address):
        return False
    others = [r for r, a in enumerate(ours) if a and r != rank]
    return not others or any(r < len(theirs) and theirs[r] == ours[r] for r in others)
