"""The nouns the block directory answers with (pure): a block's :class:`Location`, a
query's :class:`QueryResult` (with its compact wire form), a :class:`LeaseRecord`, the
:class:`DirectoryStats`, lease ids (:func:`fresh_lease_ids`).  Used by
:mod:`.block_directory` and by everything that reads its answers."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Any, NamedTuple, Tuple

import numpy as np

SlotId = Tuple[int, int, int, int]  # (rank, tier, group, slot)


class LeaseRecord(NamedTuple):
    """One outstanding lease: the slot it holds, who holds it, since when (the clock's)."""
    slot: SlotId
    holder: int
    granted_at: float


class Location(NamedTuple):
    """Where one copy of a block lives: rank, tier, group, slot, the slot's generation (a
    reused slot gets a new one) and the incarnation of the storage that wrote it (0: not
    named, e.g. a test's rows; such a read fails a loader's check against a storage that
    names its incarnation)."""
    rank: int
    tier: int
    group: int
    slot: int
    generation: int
    incarnation: int = 0


@dataclass(frozen=True)
class QueryResult:
    """Hits of one query, in key order (a prefix of the asked keys), and their leases."""

    keys: Tuple[int, ...]
    locations: Tuple[Location, ...]
    lease_ids: Tuple[int, ...]

    @property
    def num_hits(self) -> int:
        return len(self.keys)

    def __reduce__(self) -> Tuple[Any, Tuple[Tuple[int, ...], np.ndarray, np.ndarray]]:
        """A compact wire form (each lookup's answer crosses from the directory to a
        scheduler): locations and leases as int64 arrays.  Pickled object by object, 512
        hits took ~2.2 ms (dumps + loads) on the CPU machine, on every hit's path to its
        first token."""
        flat = itertools.chain.from_iterable(self.locations)
        locations = np.fromiter(flat, np.int64, len(self.locations) * len(Location._fields))
        return _query_result, (self.keys, locations,
                               np.fromiter(self.lease_ids, np.int64, len(self.lease_ids)))


def _query_result(keys: Tuple[int, ...], locations: np.ndarray,
                  lease_ids: np.ndarray) -> QueryResult:
    """:class:`QueryResult` from its wire form (:meth:`QueryResult.__reduce__`)."""
    rows = locations.reshape(-1, len(Location._fields)).tolist()
    return QueryResult(keys, tuple(map(Location._make, rows)), tuple(lease_ids.tolist()))


#: lease ids of one directory incarnation start at a random offset below this bound, so
#: that the ranges of two incarnations overlap with a chance of about (leases granted) / 2**62
LEASE_ID_SPACE = 2 ** 62


def fresh_lease_ids() -> itertools.count[int]:
    """Lease ids of a new directory incarnation: consecutive from a random start, so that a
    release that outlived an older incarnation (a re-created supervisor actor) names no
    lease of this one and is counted as unknown.  Stays within ``int64``."""
    return itertools.count(1 + secrets.randbelow(LEASE_ID_SPACE))


@dataclass
class DirectoryStats:
    """The directory's counters (``VLLMBlockTracker.stats``)."""
    registered: int = 0
    queries: int = 0
    hit_blocks: int = 0
    missed_queries: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    unknown_releases: int = 0
    #: leases dropped because they outlived ``lease_ttl_s``, or their holder went
    leases_expired: int = 0
    leases_of_gone_holders: int = 0
    claims_refused: int = 0
    #: leases :meth:`BlockDirectory.lease` could not grant (the bound reached)
    leases_refused: int = 0
    #: entries dropped because their rank no longer held the block (:meth:`forget`)
    forgotten: int = 0
    stale_registrations: int = 0
    #: lookups that found another block name with the same low 63 bits (a miss)
    identity_mismatches: int = 0
