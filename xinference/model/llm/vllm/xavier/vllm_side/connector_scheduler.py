"""The scheduler half of :class:`~.connector.XavierConnector` (engine-core process).

Translates vLLM's requests and blocks for :class:`~..planning.scheduler_side.
SchedulerSide`: a request's directory lookup leaves when the request arrives, batched
with the others of that moment (:class:`~..planning.lookups.DirectoryLookups`); a hit
becomes an asynchronous load in vLLM's sense; each step's loads, exports and figures
leave as ONE :class:`~..planning.step_meta.StepMeta`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Collection,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import numpy as np

from ..mechanism.host_holders import HostHolders
from ..planning.block_directory import QueryResult
from ..planning.block_names import block_name
from ..planning.coalesced_forgets import CALL_TIMEOUT_S as FORGET_CALL_TIMEOUT_S
from ..planning.coalesced_forgets import CoalescedForgets
from ..planning.counters import elapsed_us
from ..planning.directory_types import Packed
from ..planning.hash_seed import user_seed
from ..planning.in_place import InPlaceBook
from ..planning.lease_release import BatchingReleaser, directory_sender
from ..planning.load_batch import DEST, Tier
from ..planning.load_cost import LoadCost
from ..planning.log_names import package_logger
from ..planning.lookups import DirectoryLookups
from ..planning.options import XavierOptions
from ..planning.routes import host_id
from ..planning.scheduler_side import SchedulerSide
from ..planning.shards import Shards
from ..planning.step_meta import EmptySteps, StepMeta
from . import none_hash
from .actor_bridge import ActorBridge, LazyActor
from .pool_watch import watch_block_pool

if TYPE_CHECKING:  # pragma: no cover
    import concurrent.futures

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = package_logger(__name__)

#: how often the scheduler half asks whether the worker attached (until it has)
READY_RECHECK_S = 0.5
READY_CALL_S = 2.0
#: how often the scheduler asks the directory where same-host peers' host indexes are
HOST_POLL_S = 1.0
#: the longest a replica's first lookup waits for its first answer of which host indexes
#: this host has (once; a peer's blocks published while the launch is on one host are in
#: those indexes only; 2 s was not enough on CI's loaded machine, most likely)
FIRST_HOST_POLL_S = 10.0
#: longest the engine's start waits for the launch's block-hash seed from the directory
SEED_CALL_S = 30.0


def sharing_allowed(request: Request) -> bool:
    """Whether ``request`` takes part in sharing (``kv_transfer_params={"xavier": false}``
    opts it out: no lookup, no export)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    value = params.get("xavier", True) if isinstance(params, dict) else True
    return value not in (False, "false", "off", 0)


def reads_prefix_cache(request: Request) -> bool:
    """Whether vLLM lets ``request`` start from cached blocks: not when it skips reading
    the prefix cache (``skip_reading_prefix_cache``, e.g. a request for prompt logprobs,
    which needs every prompt token computed).  Such a request is never offered a load."""
    return not bool(getattr(request, "skip_reading_prefix_cache", False))


class XavierConnectorScheduler:
    """Scheduler-side state of one replica: lookups, hits and their leases, step metadata.

    Owns the replica's leases, their releaser and the directory lookups: every lease the
    replica takes (when a step that loads is built) is released here, when vLLM reports the
    load done on every worker (:meth:`loads_finished`), or at :meth:`shutdown`."""

    def __init__(self, options: XavierOptions, block_size: int, num_groups: int,
                 bridge: ActorBridge, tp_size: int = 1, overlapped: bool = True,
                 token_budget: Optional[int] = None) -> None:
        self.options = options
        self._bridge = bridge
        self._ready = False
        self._next_ready_check = 0.0
        self._directory = LazyActor(bridge, options.block_tracker_address,
                                    options.block_tracker_uid, checked=False)
        self._releaser = releaser = BatchingReleaser(
            directory_sender(self._directory, bridge.start), bridge.schedule)
        self._release_failures_counted = 0
        self._forgets = CoalescedForgets(self._send_forget)  # one call out at a time
        self._forgets_coalesced = 0
        self._empty_steps = EmptySteps()  # which steps are StepMeta.idle
        #: same-host peers' host indexes (``xavier_host_index``), as the directory announces
        #: them (asked every ``HOST_POLL_S``, never waited for)
        self._holders: Optional[HostHolders] = None
        if options.in_place and options.host_index:
            self._holders = HostHolders(options.rank, Shards(max(1, num_groups), tp_size))
        self._host_poll: Optional[concurrent.futures.Future[Any]] = None
        self._next_host_poll = 0.0
        self._waited_first_poll = False
        self._host = host_id()
        self.side = SchedulerSide(options.rank, block_size, max(1, num_groups),
                                  DirectoryLookups(self._send_lookups), releaser.release_many,
                                  take_leases=self._take_leases, tp_size=tp_size,
                                  cost=LoadCost(lag=1 if overlapped else 0,
                                                token_budget=token_budget),
                                  decline=options.load_policy == "cost",
                                  on_host=self._find_on_host if self._holders else None,
                                  publish_loaded=options.in_place)
        #: vLLM's cache read in place (``options.in_place``): the book of published blocks
        #: once the workers' block generations are known (:meth:`_open_in_place`)
        self._book: Optional[InPlaceBook] = None
        self._generations: List[Any] = []
        self._next_book_check = 0.0
        self._reused_counted = 0
        #: the launch's seed, until the first request checked that vLLM hashes with it
        self._unchecked_seed: Optional[str] = None
        if user_seed() is None:  # else vLLM seeds every replica from the user's value
            self._unchecked_seed = self._launch_seed()
            none_hash.seed_next_init(self._unchecked_seed)

    def _launch_seed(self) -> str:
        """The launch's secret block-hash seed, from the block directory (the engine does
        not start without it: its blocks would match no other replica's)."""
        ref = self._directory.get()
        try:
            seed = self._bridge.call(lambda: ref.hash_seed(), timeout=SEED_CALL_S)
        except Exception as exc:
            raise RuntimeError(
                f"xavier: rank {self.options.rank}: the launch's block-hash seed could not be "
                f"fetched from the block directory at {self.options.block_tracker_address} "
                f"({type(exc).__name__}: {exc})") from None
        if not isinstance(seed, str) or not seed:
            raise RuntimeError(f"xavier: rank {self.options.rank}: the block directory gave "
                               "no block-hash seed")
        return seed

    def seed_problem(self) -> Optional[str]:
        """Once, when the first request arrives: why this engine's block hashes cannot
        match the other replicas' (vLLM did not seed them with the launch's seed), or
        None."""
        seed, self._unchecked_seed = self._unchecked_seed, None
        if seed is None or none_hash.seeded_with(seed):
            return None
        return ("vLLM's NONE_HASH is not the launch's block-hash seed (vLLM's engine core "
                "did not call init_none_hash as expected), so no block would match another "
                "replica's")

    def _send_lookups(self, batch: Sequence[Any]) -> concurrent.futures.Future[List[QueryResult]]:
        ref = self._directory.get()  # unchecked: a ref without a lookup
        groups = self.side.shards.directory_groups
        requests = [list(keys) for _, keys in batch]  # (lists of ints: serialized fast)
        rank = self.options.rank
        # no lease with the answer: a step leases what it loads (_take_leases)
        return self._bridge.start(lambda: ref.query_many(groups, requests, rank, False))

    def _find_on_host(self, keys: Sequence[int]) -> Optional[Tuple[QueryResult, bool]]:
        """The longest prefix of ``keys`` a same-host peer holds (its host index), and
        whether the block after it was held there once."""
        self._poll_host_indexes()
        return self._holders.find(keys) if self._holders is not None else None

    def _poll_host_indexes(self) -> None:
        """Map the host indexes the directory announced last; ask again every
        ``HOST_POLL_S`` (the answer is taken by a later call, never waited for -- but the
        first, at most ``FIRST_HOST_POLL_S``: a replica that just started must see its peers'
        indexes before its first lookup, since blocks published while the launch is on
        one host are in those indexes only)."""
        if self._holders is None:
            return
        fut = self._host_poll
        if fut is not None and not self._waited_first_poll:
            self._waited_first_poll = True  # (once: a directory that does not answer)
            if concurrent.futures.wait([fut], timeout=FIRST_HOST_POLL_S).not_done:
                logger.warning("xavier: rank %d: which host indexes this host has was not "
                               "known within %.0f s: blocks its peers published into them "
                               "only are missed until it is", self.options.rank,
                               FIRST_HOST_POLL_S)
        now = time.monotonic()
        if fut is not None and not fut.done() and now > self._next_host_poll + HOST_POLL_S:
            fut.cancel()  # unanswered for two periods (a directory gone): ask again
            self._host_poll = None  # (the last answer stands: a flip would cost a republication)
        elif fut is not None and fut.done():
            self._host_poll = None
            try:
                self._holders.update(*fut.result())
            except Exception as exc:  # an older directory, or gone: the last answer stands
                logger.debug("xavier: rank %d: host indexes: %r", self.options.rank, exc)
        if self._host_poll is None and now >= self._next_host_poll:
            self._next_host_poll = now + HOST_POLL_S
            ref, host = self._directory.get(), self._host
            self._host_poll = self._bridge.start(lambda: ref.host_view(host))
            if not self._waited_first_poll:  # (the first answer, taken at once)
                self._poll_host_indexes()

    def _take_leases(self, locations: np.ndarray) -> concurrent.futures.Future[List[int]]:
        """Leases for this rank's load of ``locations`` (rows of
        :class:`~..planning.directory_types.Location` fields; one directory call, not waited
        for)."""
        ref = self._directory.get()
        rank = self.options.rank
        return self._bridge.start(lambda: ref.lease(rank, locations))  # (an array: one buffer)

    def is_ready(self) -> bool:
        """Whether this rank's worker has attached to its transfer actor (the actor is
        created after the engine starts; until then no hit is offered).  Asked of the actor
        when a request arrives, at most every ``READY_RECHECK_S``, each ask bounded by
        ``READY_CALL_S``; once true it stays true."""
        if self._ready:
            return True
        now = time.monotonic()
        if now < self._next_ready_check:
            return False
        self._next_ready_check = now + READY_RECHECK_S
        try:
            self._ready = bool(self._bridge.call(self._probe_ready, timeout=READY_CALL_S))
        except Exception as exc:  # a pool still starting was seen not to answer at all
            logger.debug("xavier: transfer actor not ready: %r", exc)
        if self._ready:
            logger.info("xavier: rank %d: sharing is on (the worker attached)",
                        self.options.rank)
        return self._ready

    async def _probe_ready(self) -> bool:
        import xoscar as xo

        ref = await xo.actor_ref(self.options.rank_address, self.options.transfer_actor_uid)
        return bool(await ref.is_ready())

    def on_new_request(self, request: Request) -> None:
        """Start ``request``'s lookup (see ``XavierConnector.on_new_request``)."""
        with elapsed_us(self.side.add_time):
            self.side.track(request.request_id, _key_source(request), request.num_tokens,
                            sharing_allowed(request), self.is_ready(),
                            reads_prefix_cache(request))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """``(n, n > 0)`` or ``(None, False)`` while the lookup is out (no lease held)."""
        with elapsed_us(self.side.add_time):
            ready = self.is_ready()
            self.side.track(request.request_id, _key_source(request), request.num_tokens,
                            sharing_allowed(request), ready, reads_prefix_cache(request))
            n = self.side.match(request.request_id, request.num_tokens, num_computed_tokens,
                                ready)
        if n is None:
            return None, False
        return n, n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Bind the hit to its allocated blocks (its loads go out with the next step)."""
        with elapsed_us(self.side.add_time):
            block_ids = blocks.get_block_ids()
            null = [[bool(b.is_null) for b in group] for group in blocks.blocks]
            self.side.allocated(request.request_id, block_ids, null, num_external_tokens)

    # ------------------------------------------------------ vLLM's cache in place
    def bind_pool(self, pool: Any) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``): with ``in_place``, watch where it
        hands blocks out (:mod:`.pool_watch`)."""
        if self.options.in_place:
            watch_block_pool(pool, self._handed_out, self._reset)

    def _handed_out(self, block_ids: Sequence[int]) -> None:
        if self._book is not None:
            self._book.handed_out(block_ids)

    def _reset(self) -> None:
        """vLLM reset its prefix cache (an operator's call, not a step): every published
        block's entry leaves the directory before the reset returns."""
        if self._book is None:
            return
        self._book.reset()
        forgotten = self._book.take_forgotten()
        if forgotten:
            ref = self._directory.get()
            rank = self.options.rank
            try:
                self._bridge.call(lambda: ref.forget(rank, int(Tier.VLLM), Packed(forgotten)),
                                  timeout=READY_CALL_S)
            except Exception as exc:  # the entries then fail their readers' checks
                logger.warning("xavier: rank %d: forgetting the published blocks at a "
                               "prefix-cache reset failed: %r", self.options.rank, exc)

    def _open_in_place(self) -> None:
        """Once every TP worker of THIS engine shared its cache: map their block generations
        (asked of the transfer actor like :meth:`is_ready`: at most every
        ``READY_RECHECK_S`` until it answers, each ask bounded by ``READY_CALL_S``; in the
        step that first sees the engine ready, so that the blocks it computes are published).
        Until then no block is published (a block handed out unbumped could be named):
        exports are dropped."""
        now = time.monotonic()
        if self._book is not None or not self._ready or now < self._next_book_check:
            return
        self._next_book_check = now + READY_RECHECK_S
        from ..mechanism.slot_generations import SlotGenerations

        gens: List[Any] = []
        try:
            handles = self._bridge.call(self._probe_in_place, timeout=READY_CALL_S)
            if len(handles) != self.side.shards.tp_size:
                return  # not every worker of this engine registered yet
            for handle in handles:
                gens.append(SlotGenerations.open(handle))
        except Exception as exc:  # a worker gone meanwhile, its file with it: ask again
            for g in gens:
                g.close()
            logger.info("xavier: rank %d: the workers' block generations not mapped yet: %r",
                        self.options.rank, exc)
            return
        self._generations = gens
        self._book = InPlaceBook([g.row(int(Tier.VLLM), 0) for g in gens], self.side.shards)
        logger.info("xavier: rank %d: publishing from vLLM's KV cache in place (%d blocks)",
                    self.options.rank, self._book.num_blocks)

    async def _probe_in_place(self) -> List[Any]:
        import xoscar as xo

        ref = await xo.actor_ref(self.options.rank_address, self.options.transfer_actor_uid)
        return list(await ref.in_place_generations())

    def _in_place_step(self, meta: StepMeta, zeroed: Collection[int]) -> StepMeta:
        """The step's newly full blocks published in place (no export copies), the step's
        load destinations marked loaded, the published blocks vLLM handed out saved as
        ``xavier_save_victims`` says (never those vLLM zeroes first, nor those a same-host
        peer holds in its vLLM cache now: a redundant copy costs the step and serves
        nobody), their entries forgotten (one directory call)."""
        exports, meta.exports = meta.exports, ()
        book = self._book
        if book is None:
            return meta
        meta.in_place = book.publish(exports)
        # the whole launch on this host: published into the host indexes only, and the
        # directory keeps none of this rank's in-place blocks (nothing to forget there)
        meta.in_place_local = local = (self.options.local_publish and self._holders is not None
                                       and self._holders.whole_launch)
        book.loaded(meta.loads.table[:, DEST].tolist())
        saves = book.take_saves(zeroed, self.options.save_victims,
                                self._holders.holding if self._holders is not None else None)
        meta.saves = saves.rows
        meta.stats.in_place_victims_held_elsewhere += saves.held_elsewhere
        meta.stats.in_place_victims_never_shared += saves.never_shared
        forgotten = book.take_forgotten()
        meta.stats.in_place_published += len(meta.in_place)
        meta.stats.in_place_victims += len(meta.saves)
        meta.stats.in_place_reused += book.reused - self._reused_counted
        self._reused_counted = book.reused
        if forgotten and not local:
            self._forgets.add(forgotten)
            meta.stats.forgets_coalesced += self._forgets.coalesced - self._forgets_coalesced
            self._forgets_coalesced = self._forgets.coalesced
        return meta

    def _send_forget(self, forgotten: Any) -> concurrent.futures.Future[Any]:
        ref, rank = self._directory.get(), self.options.rank
        return self._bridge.start(lambda: asyncio.wait_for(
            ref.forget(rank, int(Tier.VLLM), Packed(forgotten)), FORGET_CALL_TIMEOUT_S))

    def build_step(self, scheduler_output: SchedulerOutput) -> StepMeta:
        """ONE step's metadata from vLLM's scheduler output (not modified)."""
        t0 = time.perf_counter()
        nst = scheduler_output.num_scheduled_tokens
        scheduled = [(r.req_id, int(r.num_computed_tokens), int(nst.get(r.req_id, 0)))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        new_blocks: Dict[str, Any] = {}
        for i, rid in enumerate(cached.req_ids):
            scheduled.append((rid, int(cached.num_computed_tokens[i]), int(nst.get(rid, 0))))
            new_blocks[rid] = (cached.new_block_ids[i], rid in resumed)
        if self.options.in_place:
            self._open_in_place()
        self._poll_host_indexes()
        self.side.add_time(int(1e6 * (time.perf_counter() - t0)))  # counted in this step
        t1 = time.perf_counter()
        meta = self.side.build_step(scheduled, new_blocks)
        if self._holders is not None:
            meta.stats.host_index_peers = len(self._holders.ranks)
            meta.stats.host_index_whole_launch = int(self._holders.whole_launch)
        failures = self._releaser.failures  # release calls that failed since the last step
        meta.stats.lease_release_failures = failures - self._release_failures_counted
        self._release_failures_counted = failures
        if self.options.in_place:
            # vLLM 0.27 zeroes some new blocks before the worker's first hook of the step
            zeroed = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
            meta = self._in_place_step(meta, zeroed)
        meta.idle = self._empty_steps.idle(int(scheduler_output.total_num_scheduled_tokens))
        # the step's own building (its stats were taken above): counted in it too
        meta.stats.scheduler_us += int(1e6 * (time.perf_counter() - t1))
        return meta

    def loads_finished(self, request_ids: Iterable[str]) -> None:
        """vLLM's ``finished_recving`` (every worker reported these loads done): their
        leases are released."""
        self.side.loads_finished(request_ids)

    def request_finished(self, request: Request) -> None:
        """Forget ``request``; release what it holds, except the leases of a load still in
        flight (released by :meth:`loads_finished`)."""
        self.side.finished(request.request_id)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Release every lease still held and wait (bounded) for the releases to reach the
        directory (lease calls still unanswered first).  Idempotent."""
        deadline = time.monotonic() + timeout
        pending = self.side.close()
        if self._holders is not None:
            self._holders.close()
        if pending:
            concurrent.futures.wait(pending, timeout=timeout)
        if not self._releaser.flush(max(0.0, deadline - time.monotonic())):
            logger.warning("xavier: rank %d: lease releases still unsent at shutdown (the "
                           "directory drops them with the rank, or after their expiry)",
                           self.options.rank)


def _key_source(request: Request) -> Any:
    """The names of ``request``'s full blocks (:func:`~..planning.block_names.block_name`
    of vLLM's block hashes), computed incrementally."""
    cache: List[int] = []

    def keys() -> List[int]:
        hashes = request.block_hashes
        while len(cache) < len(hashes):
            cache.append(block_name(hashes[len(cache)]))
        return cache

    return keys
