"""The nouns the block directory answers with (pure): a block's :class:`Location`, a
query's :class:`QueryResult` (with its compact wire form), a :class:`LeaseRecord`, the
:class:`DirectoryStats`; and :class:`Packed`, the wire form of a call's bulk argument.
Used by :mod:`.block_directory` and by everything that reads its answers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np


@dataclass(frozen=True)
class Packed:
    """A bulk argument of a call to the directory's actor made of tuples (a registration's
    or a demotion's rows, forgotten ``(slot, generation)`` pairs), sent as one object.
    xoscar's serializer walks a list of tuples item by item (its ``CollectionSerializer``)
    but pickles an object it has no serializer for whole, in C: on the CPU machine a
    registration of 512 rows cost the engine's process 3.3-3.6 ms of CPU as a list and
    1.2-1.6 ms packed, of which ~0.4 ms is the call itself and ~0.4 ms making every field a
    plain int (``benchmarks/directory_call_bench.py``, session 40) -- CPU taken, under the
    GIL, from the step it runs beside.  A list of plain ints (a lookup's keys) costs the
    same either way, and an array crosses as one buffer.  The receiver takes
    :func:`unpacked`."""

    value: Any


def unpacked(arg: Any) -> Any:
    """``arg``'s value if it came :class:`Packed`, else ``arg`` itself (an older caller,
    an in-process one)."""
    return arg.value if isinstance(arg, Packed) else arg


class LeaseRecord(NamedTuple):
    """One outstanding lease: the slot it holds (its rank, its place on the rank:
    :func:`~.directory_entries.place`), who holds it, since when (the clock's)."""
    slot: Tuple[int, int]
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


#: columns of :attr:`QueryResult.table`: :class:`Location`'s fields in order
LOCATION_COLUMNS = len(Location._fields)


class QueryResult:
    """Hits of one query, in key order (a prefix of the asked keys), and their leases.

    Held as arrays (:attr:`table`: one int64 row of :class:`Location` fields per hit,
    :attr:`lease_table`), which is also its wire form: a scheduler slices and loads them
    without one Python object per block.  :attr:`locations` and :attr:`lease_ids` give
    the same as tuples (built when first asked)."""

    __slots__ = ("keys", "table", "lease_table", "_locations")

    def __init__(self, keys: Sequence[int], locations: Union[Sequence[Location], np.ndarray],
                 lease_ids: Union[Sequence[int], np.ndarray]) -> None:
        self.keys: Tuple[int, ...] = tuple(keys)
        self._locations: Optional[Tuple[Location, ...]] = None
        if isinstance(locations, np.ndarray):
            table = locations.astype(np.int64, copy=False).reshape(-1, LOCATION_COLUMNS)
        else:
            self._locations = tuple(Location(*x) for x in locations)
            flat = itertools.chain.from_iterable(self._locations)
            table = np.fromiter(flat, np.int64, len(self._locations) * LOCATION_COLUMNS
                                ).reshape(-1, LOCATION_COLUMNS)
        self.table: np.ndarray = table
        self.lease_table: np.ndarray = np.asarray(lease_ids, np.int64).reshape(-1)

    @property
    def num_hits(self) -> int:
        return len(self.keys)

    @property
    def locations(self) -> Tuple[Location, ...]:
        if self._locations is None:
            self._locations = tuple(map(Location._make, self.table.tolist()))
        return self._locations

    @property
    def lease_ids(self) -> Tuple[int, ...]:
        return tuple(self.lease_table.tolist())

    def followed_by(self, other: QueryResult, limit: int, skip: int = 0) -> QueryResult:
        """These hits, then at most ``limit`` of ``other``'s from its ``skip``-th (``other``
        answers keys of which the ``skip``-th is the one right after these, in the same
        groups)."""
        n, m = self.num_hits, max(0, min(other.num_hits - skip, limit))
        if not m:
            return self
        groups = len(self.table) // n if n else len(other.table) // other.num_hits
        o = other.num_hits
        table = np.concatenate([self.table.reshape(groups, n, -1),
                                other.table.reshape(groups, o, -1)[:, skip:skip + m]], 1)
        leases = np.concatenate([self.lease_table.reshape(groups, n),
                                 other.lease_table.reshape(groups, o)[:, skip:skip + m]], 1)
        return QueryResult(self.keys + other.keys[skip:skip + m],
                           table.reshape(-1, LOCATION_COLUMNS), leases.reshape(-1))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QueryResult):
            return NotImplemented
        return (self.keys == other.keys and np.array_equal(self.table, other.table)
                and np.array_equal(self.lease_table, other.lease_table))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"QueryResult(keys={self.keys!r}, locations={self.locations!r}, "
                f"lease_ids={self.lease_ids!r})")

    def __reduce__(self) -> Tuple[Any, Tuple[Tuple[int, ...], np.ndarray, np.ndarray]]:
        """A compact wire form (each lookup's answer crosses from the directory to a
        scheduler): its arrays.  Pickled object by object, 512 hits took ~2.2 ms (dumps
        + loads) on the CPU machine, on every hit's path to its first token."""
        return QueryResult, (self.keys, self.table, self.lease_table)


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
    #: leases :meth:`~.block_directory.BlockDirectory.lease` could not grant (the bound reached)
    leases_refused: int = 0
    #: entries dropped because their rank no longer held the block
    #: (:meth:`~.block_directory.BlockDirectory.forget`)
    forgotten: int = 0
    stale_registrations: int = 0
    #: lookups that found another block name with the same low 63 bits (a miss)
    identity_mismatches: int = 0
