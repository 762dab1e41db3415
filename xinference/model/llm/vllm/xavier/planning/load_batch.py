"""The compact wire format of one scheduler step's KV loads.

A step carries every scheduled request's loads in ONE int64 table, so that a
single xoscar call moves the whole step (one pickled buffer instead of
thousands of Python tuples).  Each row is one block position of one request:

=========  ===============================================================
column     meaning
=========  ===============================================================
group      KV-cache group id (vLLM ``kv_cache_config.kv_cache_groups``)
key        the low 63 bits of the block's name (:func:`~.block_names.block_name`)
rank       source rank that holds the block
tier       storage tier on that rank (:class:`Tier`)
slot       slot index in that rank's tier storage
dest       destination block id in the loading replica's KV cache
gen        the slot's generation when the source published the block
inc        the incarnation of the source's storage that published it
=========  ===============================================================

``gen`` and ``inc`` are the identity a loader checks after its copy against the source's
own record of the slot (:mod:`~..mechanism.read_checks`); 0 names no storage (a row
built without a directory entry), which fails against every storage that names one.

Pure module: numpy only, no torch, no actors.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

COLUMNS: Tuple[str, ...] = ("group", "key", "rank", "tier", "slot", "dest", "gen", "inc")
GROUP, KEY, RANK, TIER, SLOT, DEST, GEN, INC = range(len(COLUMNS))

#: vLLM's shared null block (``BlockPool.null_block``) has block id 0.
NULL_BLOCK_ID = 0


class Tier(enum.IntEnum):
    """Where a block lives on its source rank: Xavier's snapshot tiers (``GPU``, ``CPU``),
    or ``VLLM``: the source replica's own vLLM KV cache, read in place (the slot is vLLM's
    block id; its generation is bumped whenever vLLM hands the block out to be written:
    :mod:`~.in_place`)."""

    GPU = 0
    CPU = 1
    VLLM = 2


def read_preference(tier: int) -> int:
    """Which copy of a block a reader prefers (lower first): device memory (a GPU tier,
    or vLLM's own cache read in place) before host memory."""
    return 1 if tier == Tier.CPU else 0


#: the lease id of a location that needs none (vLLM's cache read in place: its reads are
#: checked after the copy, nothing of Xavier's is reused under them)
NO_LEASE = 0


class LoadBatchError(ValueError):
    """Malformed step metadata; the message names the offending field."""


@dataclass(frozen=True)
class BlockLoad:
    """One block position of one request (convenience form for tests and callers)."""

    group: int
    key: int
    rank: int
    tier: int
    slot: int
    dest: int
    generation: int = 0
    incarnation: int = 0

    def as_row(self) -> Tuple[int, ...]:
        return (self.group, self.key, self.rank, self.tier, self.slot, self.dest,
                self.generation, self.incarnation)


@dataclass(frozen=True)
class LoadBatch:
    """All loads of one scheduler step.

    ``table`` is an int64 array of shape ``[N, 8]`` (columns :data:`COLUMNS`);
    rows ``offsets[i]:offsets[i+1]`` belong to ``request_ids[i]``.  The
    constructor validates everything and raises :class:`LoadBatchError` naming
    the bad field; a batch that exists is well formed.
    """

    request_ids: Tuple[str, ...]
    offsets: np.ndarray
    table: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        ids = tuple(self.request_ids)
        object.__setattr__(self, "request_ids", ids)
        if len(set(ids)) != len(ids):
            raise LoadBatchError("request_ids: duplicate request id in one step")
        for rid in ids:
            if not isinstance(rid, str):
                raise LoadBatchError(f"request_ids: expected str, got {type(rid).__name__}")
        offsets = _as_int64("offsets", self.offsets, ndim=1)
        table = _as_int64("table", self.table, ndim=2)
        if table.shape[1] != len(COLUMNS):
            raise LoadBatchError(
                f"table: expected {len(COLUMNS)} columns {COLUMNS}, got shape {table.shape}")
        if offsets.shape[0] != len(ids) + 1:
            raise LoadBatchError(
                f"offsets: expected {len(ids) + 1} entries for {len(ids)} requests, "
                f"got {offsets.shape[0]}")
        if offsets[0] != 0 or offsets[-1] != table.shape[0] or np.any(np.diff(offsets) < 0):
            raise LoadBatchError(
                f"offsets: must start at 0, be non-decreasing and end at {table.shape[0]}")
        if table.shape[0]:
            negative = np.flatnonzero(table.min(axis=0) < 0)  # one pass, not one per column
            if negative.size:
                col = int(negative[0])
                bad = int(np.argmax(table[:, col] < 0))
                raise LoadBatchError(f"{COLUMNS[col]}: negative value {int(table[bad, col])} "
                                     f"in row {bad}")
            tiers = table[:, TIER]
            if int(tiers.max()) > max(Tier):  # (none negative: checked above)
                row = int(np.argmax(tiers > max(Tier)))
                raise LoadBatchError(f"tier: unknown tier {int(tiers[row])} in row {row}")
        offsets.setflags(write=False)
        table.setflags(write=False)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "table", table)

    # -- construction ------------------------------------------------------
    @classmethod
    def from_requests(
        cls, requests: Iterable[Tuple[str, Sequence[BlockLoad]]]
    ) -> LoadBatch:
        """Build a batch from ``(request_id, loads)`` pairs."""
        ids: List[str] = []
        rows: List[Tuple[int, ...]] = []
        offsets = [0]
        for rid, loads in requests:
            ids.append(rid)
            rows.extend(load.as_row() for load in loads)
            offsets.append(len(rows))
        table = np.asarray(rows, dtype=np.int64).reshape(len(rows), len(COLUMNS))
        return cls(tuple(ids), np.asarray(offsets, dtype=np.int64), table)

    @classmethod
    def from_tables(cls, request_ids: Sequence[str], tables: Sequence[np.ndarray]
                    ) -> LoadBatch:
        """Build a batch from each request's rows (an int64 ``[n, 8]`` array each)."""
        offsets = np.cumsum([0] + [len(t) for t in tables], dtype=np.int64)
        table = (np.concatenate(tables) if tables
                 else np.zeros((0, len(COLUMNS)), np.int64))
        return cls(tuple(request_ids), offsets, table)

    @classmethod
    def concat(cls, batches: Sequence[LoadBatch]) -> LoadBatch:
        """One batch carrying the requests of several (e.g. per-request) batches."""
        ids: List[str] = []
        tables = []
        offsets = [0]
        for b in batches:
            ids.extend(b.request_ids)
            tables.append(b.table)
            offsets.extend((b.offsets[1:] + offsets[-1]).tolist())
        table = np.concatenate(tables) if tables else np.zeros((0, len(COLUMNS)), np.int64)
        return cls(tuple(ids), np.asarray(offsets, dtype=np.int64), table)

    # -- views ---------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0])

    def row_request_index(self) -> np.ndarray:
        """int64 array: index into ``request_ids`` of each table row."""
        counts = np.diff(self.offsets)
        return np.repeat(np.arange(self.num_requests, dtype=np.int64), counts)

    def rows_of(self, request_id: str) -> np.ndarray:
        i = self.request_ids.index(request_id)
        return self.table[self.offsets[i]:self.offsets[i + 1]]

    def without_rows(self, drop: np.ndarray) -> Optional[LoadBatch]:
        """This batch minus the rows where ``drop`` is true (requests left without rows stay,
        empty); ``None`` when no row is left."""
        if not drop.any():
            return self
        keep = ~drop
        if not keep.any():
            return None
        counts = np.bincount(self.row_request_index()[keep], minlength=self.num_requests)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return LoadBatch(self.request_ids, offsets, self.table[keep].copy())

    def for_shard(self, tp_rank: int, tp_size: int) -> LoadBatch:
        """The rows TP worker ``tp_rank`` loads (``group`` is a directory group, see
        :mod:`.shards`), with ``group`` turned into the KV-cache group; every request stays
        (its rows may be none).  ``tp_size == 1``: this batch."""
        if tp_size == 1:
            return self
        keep = self.table[:, GROUP] % tp_size == tp_rank
        counts = np.bincount(self.row_request_index()[keep], minlength=self.num_requests)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        table = self.table[keep].copy()
        table[:, GROUP] //= tp_size
        return LoadBatch(self.request_ids, offsets, table)

    def split(self) -> List[LoadBatch]:
        """One single-request batch per request (the per-request baseline)."""
        return [
            LoadBatch((rid,), np.asarray([0, self.offsets[i + 1] - self.offsets[i]], np.int64),
                      self.table[self.offsets[i]:self.offsets[i + 1]].copy())
            for i, rid in enumerate(self.request_ids)
        ]


@functools.cache
def empty_batch() -> LoadBatch:
    """The batch of a step with no loads: one shared instance (a batch is frozen and its
    arrays read-only), so that the many steps without loads build and validate none
    (~30 µs a step on the scheduler's critical path)."""
    return LoadBatch((), np.zeros(1, np.int64), np.zeros((0, len(COLUMNS)), np.int64))


def _as_int64(name: str, value: object, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except Exception as exc:  # pragma: no cover - numpy raises many types
            raise LoadBatchError(f"{name}: not an array ({exc})") from exc
    arr: np.ndarray = value
    if arr.ndim != ndim:
        # an empty Python list gives shape (0,); accept it as an empty table
        if ndim == 2 and arr.size == 0:
            return np.zeros((0, len(COLUMNS)), np.int64)
        raise LoadBatchError(f"{name}: expected {ndim}-D array, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size and arr.dtype.kind not in "iu":
            raise LoadBatchError(f"{name}: expected integer dtype (int64), got {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise LoadBatchError(f"{name}: value does not fit in int64")
        arr = arr.astype(np.int64)
    return np.array(arr, dtype=np.int64, copy=True)
