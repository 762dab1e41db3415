"""The block directory actor (supervisor pool): ``VLLMBlockTracker``.

Imported by Xinference's supervisor at every start: xoscar and numpy only, no
torch, no vLLM.  A thin adapter over :class:`~.planning.block_directory.BlockDirectory`;
every method is synchronous, so each runs atomically in the actor.  Its
``register`` and ``claim`` are what a worker's storage writer calls
(:class:`~.planning.directory_link.DirectoryLink`, through
:class:`~.vllm_side.tracker_link.TrackerLink`).  A bulk argument may come
:class:`~.planning.directory_types.Packed` (the engines send theirs so).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import xoscar as xo

from .planning.block_directory import BlockDirectory, QueryResult
from .planning.directory_types import Location, unpacked
from .planning.hash_seed import new_launch_seed
from .planning.load_batch import Tier
from .planning.log_names import package_logger

logger = package_logger(__name__)


class VLLMBlockTracker(xo.StatelessActor):
    """Block directory of one Xavier model.

    Created by the supervisor with uid ``f"{default_uid()}-{model_uid}"`` and
    no constructor arguments, once per launch: it draws the launch's secret block-hash
    seed (:mod:`~.planning.hash_seed`), which each replica's engine fetches
    (:meth:`hash_seed`) before vLLM seeds its block hashes.
    """

    @classmethod
    def default_uid(cls) -> str:
        return "vllm-block-tracker-actor"

    def __init__(self, max_leases: int = 1_000_000) -> None:
        super().__init__()
        self._directory = BlockDirectory(max_leases=max_leases)
        self._hash_seed = new_launch_seed()
        #: (rank, tp_rank) -> (host id, path) of the workers' host indexes
        self._indexes: Dict[Tuple[int, int], Tuple[str, str]] = {}
        self._tp_size = 1  # the launch's tensor-parallel degree (one for every rank)

    def hash_seed(self) -> str:
        """The launch's secret block-hash seed (never logged)."""
        return self._hash_seed

    def register_rank(self, rank: int, tp_size: int = 1) -> None:
        """A rank's engine joins (``tp_size``: its tensor-parallel degree, which every rank
        of the launch must share; another raises, naming ``tensor_parallel_size``)."""
        self._directory.register_rank(rank, tp_size)
        self._tp_size = int(tp_size)

    def unregister_rank(self, rank: int) -> int:
        self._drop_indexes(rank)
        dropped = self._directory.unregister_rank(rank)
        if dropped:  # a rank that comes back: its old blocks go (a first start drops none)
            logger.info("block tracker: rank %d re-registered, %d old blocks dropped", rank,
                        dropped)
        return dropped

    def announce_index(self, rank: int, tp_rank: int, host: str, path: str) -> None:
        """Worker ``tp_rank`` of ``rank`` (registered) writes its published blocks into the
        host index at ``path`` on ``host`` (:mod:`~.mechanism.host_index`); until the rank
        unregisters or announces another."""
        if int(rank) not in self._directory.ranks:
            raise ValueError(f"rank: {rank} is not registered")
        self._indexes[(int(rank), int(tp_rank))] = (str(host), str(path))
        self._tp_size = max(self._tp_size, int(tp_rank) + 1)

    def _drop_indexes(self, rank: int) -> None:
        for key in [k for k in self._indexes if k[0] == int(rank)]:
            del self._indexes[key]

    def host_indexes(self, host: str, exclude_rank: Optional[int] = None
                     ) -> List[Tuple[int, int, str]]:
        """``(rank, tp_rank, path)`` of the host indexes announced on ``host``."""
        return sorted((r, t, p) for (r, t), (h, p) in self._indexes.items()
                      if h == host and r != exclude_rank)

    def forget_in_place(self, rank: int, groups: Optional[Sequence[int]] = None) -> int:
        """Drop every entry of ``rank``'s vLLM cache (``Tier.VLLM``; of directory ``groups``
        only, if given: one TP worker's), keeping its host indexes and its tiers' entries:
        the rank records them locally from now on (the whole launch is on its host,
        :mod:`~.mechanism.host_holders`)."""
        groups = unpacked(groups)
        return self._directory.forget(int(rank), int(Tier.VLLM), None,
                                      None if groups is None else sorted({int(g) for g in groups}))

    def host_view(self, host: str) -> Tuple[List[Tuple[int, int, str]], bool]:
        """The host indexes announced on ``host`` (every rank's, as :meth:`host_indexes`),
        and whether they are the whole launch's: every registered rank announced one there
        for each of its TP workers.  Then a block none of them names is held by no rank
        (:mod:`~.mechanism.host_holders`: a lookup of it is not made)."""
        announced = self.host_indexes(host)
        here = {(r, t) for r, t, _ in announced}
        ranks = self._directory.ranks
        whole = bool(ranks) and all((r, t) in here for r in ranks for t in range(self._tp_size))
        return announced, whole

    def register(self, rank: int, entries: Any, incarnation: int = 0) -> int:
        """``entries``: rows ``(group, key, tier, slot, generation)`` (list or int64 array)
        written by the storage ``incarnation`` of ``rank``."""
        return self._directory.register(rank, _entries(entries), int(incarnation))

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return self._directory.claim(rank, tier, group, [int(s) for s in unpacked(slots)])

    def forget(self, rank: int, tier: int,
               slots: Optional[Dict[int, Sequence[Sequence[int]]]] = None) -> int:
        """``rank`` no longer holds these ``group -> (slot, generation now)`` of ``tier``
        (vLLM handed its blocks out to be overwritten; None: any slot of the tier, its
        engine went): their entries go (with vLLM's whole cache, the rank's host indexes
        too: a peer stops probing them at its next poll)."""
        slots = unpacked(slots)
        if slots is None and int(tier) == int(Tier.VLLM):
            self._drop_indexes(rank)
        return self._directory.forget(int(rank), int(tier), None if slots is None else {
            int(g): [(int(s), int(n)) for s, n in ss] for g, ss in slots.items()})

    def move(self, rank: int, entries: Any, tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        """A demotion: register the lower copies, then claim ``slots`` (one call)."""
        return self._directory.move(rank, _entries(entries), tier, group,
                                    [int(s) for s in unpacked(slots)], int(incarnation))

    def query(self, group: int, keys: Any, exclude_rank: Optional[int] = None) -> QueryResult:
        return self._directory.query(group, _rows(keys), exclude_rank)

    def query_many(self, groups: Sequence[int], requests: Sequence[Any],
                   exclude_rank: Optional[int] = None, lease: bool = True
                   ) -> List[QueryResult]:
        """One scheduler step's lookups: for each request's keys, the longest prefix held
        by other ranks in every group, leased unless ``lease`` is false
        (:meth:`BlockDirectory.query_many`)."""
        reqs = [_rows(r) for r in unpacked(requests)]
        return self._directory.query_many([int(g) for g in groups], reqs, exclude_rank,
                                          bool(lease))

    def lease(self, holder: int, locations: Sequence[Any]) -> List[int]:
        """Leases for ``holder``'s load of ``locations``, taken when it allocated the
        destinations (:meth:`BlockDirectory.lease`)."""
        return self._directory.lease(int(holder), [Location(*loc) for loc in _rows(locations)])

    def release(self, lease_ids: Sequence[int]) -> int:
        return self._directory.release([int(i) for i in unpacked(lease_ids)])

    def stats(self) -> Dict[str, int]:
        d = self._directory
        out = asdict(d.stats)
        out.update(blocks=d.num_blocks, keys=d.num_keys, outstanding_leases=d.outstanding_leases)
        return out


def _rows(arg: Any) -> List[Any]:
    """A bulk argument as a list (it may come
    :class:`~.planning.directory_types.Packed`, or as an array)."""
    value = unpacked(arg)
    return value.tolist() if isinstance(value, np.ndarray) else list(value)


def _entries(arg: Any) -> List[Tuple[int, int, int, int, int]]:
    """Rows ``(group, key, tier, slot, generation)`` of a bulk argument, as plain ints."""
    return [(int(g), int(k), int(t), int(s), int(n)) for g, k, t, s, n in _rows(arg)]


async def drop_leftover_actors(supervisor: Any, model_uid: str) -> int:
    """Destroy the directory and registry of ``model_uid`` that an earlier termination left
    behind, when no model of that uid runs; returns how many were destroyed.

    Xinference 3.5.0's ``terminate_model`` raises as soon as one replica cannot be
    terminated (its worker died) and skips ``_cleanup_distributed_actors``: launching the
    same uid again then fails with ``Actor 'vllm-block-tracker-actor-<uid>' already
    exist``.  Called by the overlay's launch hook before upstream's launch."""
    from .collective_manager import CollectiveManager

    running = getattr(supervisor, "_model_uid_to_replica_info", None)
    if running is None or model_uid in running:
        return 0
    destroyed = 0
    for mapping, uid in (
            ("_block_tracker_mapping", f"{VLLMBlockTracker.default_uid()}-{model_uid}"),
            ("_collective_manager_mapping", f"{CollectiveManager.default_uid()}-{model_uid}")):
        getattr(supervisor, mapping, {}).pop(model_uid, None)
        ref = xo.create_actor_ref(supervisor.address, uid)
        if await xo.has_actor(ref):
            await xo.destroy_actor(ref)
            destroyed += 1
    if destroyed:
        logger.warning("xavier %s: destroyed %d actors an earlier termination left behind",
                       model_uid, destroyed)
    return destroyed
