"""A scheduler's view of its host's indexes (:mod:`.host_index`, issue #34): the longest
prefix a same-host peer holds in its vLLM cache, found without a round trip; and, when
the whole launch lives on this host, that no rank can hold a request's first block, so
that its directory lookup (which could only miss) is not made.

**Held nowhere.**  Every block a rank holds -- in its vLLM cache, or in Xavier's GPU
snapshot or CPU tier after vLLM handed it out (a victim save) -- was first published in
place by the worker that computed or loaded it, which wrote it into its host index
(:class:`~.host_index.HostIndexLink`).  Its entry names it ("seen") while the block is
held and after, until its bucket needs the way (stale entries go first, oldest first:
about as many stale entries as vLLM has blocks survive).  So when the directory says its
registered ranks are exactly those that announced an index of every TP worker on this
host (:meth:`~..block_tracker.VLLMBlockTracker.host_view`), every one of them is mapped
here and still open, and none names a request's first block, the directory holds no hit
for the request either: the miss is answered at once.  Without this every request that
shares nothing (a unique prompt, a conversation's first turn) waited for the directory's
answer before vLLM scheduled it -- a round trip to the supervisor, 1.7 ms at C1 on an
H100 and more while the directory's actor is busy -- and added to that actor's load.

What it can cost is a hit, never a wrong block (what is loaded is still checked after its
copy): an entry lost (a full bucket's way reused, a failed insert, a victim kept in a
tier longer than its entry lived) or a rank of another host registered since the last
poll makes a hit look like a miss, and vLLM computes the block.  Counted per answer:
``lookups_skipped_held_nowhere``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..planning.directory_types import LOCATION_COLUMNS, QueryResult
from ..planning.in_place import PeerHolding
from ..planning.load_batch import NO_LEASE, Tier
from ..planning.shards import Shards
from .host_index import HostIndex, name_words

#: ``(rank, tp_rank, path)`` of an index announced in the block directory
Announced = Tuple[int, int, str]

#: :meth:`HostHolders.find`'s answer for a request whose first block no rank can hold
HELD_NOWHERE = QueryResult((), np.zeros((0, LOCATION_COLUMNS), np.int64), np.zeros(0, np.int64))


class HostHolders:
    """A scheduler's view of the host indexes of its host: :meth:`update` with what the
    directory announces, :meth:`find` a request's longest prefix held by a same-host peer
    (or that no rank holds its first block), :meth:`holding` whether a peer holds the
    step's victims (scheduler thread only)."""

    def __init__(self, own_rank: int, shards: Shards) -> None:
        self._own_rank, self._shards = own_rank, shards
        self._tables: Dict[Tuple[int, int], HostIndex] = {}  # the peers'
        #: this rank's own workers' (for what it ever held: its tiers may hold those)
        self._own: Dict[Tuple[int, int], HostIndex] = {}
        #: the mapped indexes are every rank's of the launch (``update``'s word, all opened)
        self.whole_launch = False
        self.open_failures = 0

    def update(self, announced: Sequence[Announced], whole_launch: bool = False) -> None:
        """The host's indexes now (this rank's own among them): new ones mapped, gone or
        replaced ones let go.  ``whole_launch``: the directory's word that they are every
        registered rank's, each TP worker's (:meth:`find` may then answer held nowhere)."""
        wanted = {(int(r), int(t)): str(p) for r, t, p in announced}
        for tables in (self._tables, self._own):
            for key in [k for k, ix in tables.items() if wanted.get(k) != ix.path]:
                tables.pop(key).close()
        failed = False
        for key, path in wanted.items():
            tables = self._own if key[0] == self._own_rank else self._tables
            if key in tables:
                continue
            try:
                index = HostIndex.open(path)
            except (OSError, ValueError):  # gone meanwhile, or not what it claims: no hits
                self.open_failures += 1
                failed = True
                continue
            if (index.rank, index.tp_rank) != key:
                index.close()
                self.open_failures += 1
                failed = True
                continue
            tables[key] = index
        self.whole_launch = whole_launch and not failed

    @property
    def ranks(self) -> List[int]:
        """Peers with every shard's index mapped."""
        tp = self._shards.tp_size
        return sorted(r for r in {r for r, _ in self._tables}
                      if all((r, t) in self._tables for t in range(tp)))

    def find(self, keys: Sequence[int]) -> Optional[Tuple[QueryResult, bool]]:
        """The longest prefix of ``keys`` that one same-host peer holds in every directory
        group (``Tier.VLLM`` locations, no leases), and whether the block right after it
        was held there once (its entry moved on: vLLM handed it out, so Xavier's tiers may
        hold it now -- worth asking the directory).  ``(HELD_NOWHERE, False)`` when no rank
        of the launch can hold the first (module docstring); None when no peer holds the
        first now but the directory may know a holder."""
        if not keys:
            return None
        groups = self._shards.directory_groups
        first = name_words(keys[:1])
        words: Optional[np.ndarray] = None
        best: Optional[Tuple[int, int, bool, List[Tuple[np.ndarray, np.ndarray, int]]]] = None
        seen_first = False
        for rank in self.ranks:
            probes = [self._lookup(rank, g, first) for g in groups]
            seen_first = seen_first or any(bool(seen[0]) for _, _, seen in probes)
            if any(block[0] < 0 for block, _, _ in probes):
                continue
            if words is None:
                words = name_words(keys)
            n, found, seen_next = len(keys), [], np.zeros(len(keys) + 1, bool)
            for g in groups:
                index = self._tables[(rank, self._shards.tp_rank(g))]
                block, gen, seen = index.find(g, words[:n])
                missing = np.flatnonzero(block < 0)
                n = int(missing[0]) if len(missing) else n
                seen_next[:len(seen)] |= seen
                found.append((block, gen, index.incarnation))
            if n and (best is None or n > best[1]):
                best = (rank, n, bool(seen_next[n]), found)
        if best is None:
            nowhere = not seen_first and self._unseen_by_the_launch(first)
            return (HELD_NOWHERE, False) if nowhere else None
        rank, n, evicted_next, found = best
        table = np.zeros((len(groups) * n, LOCATION_COLUMNS), np.int64)
        for i, (g, (block, gen, incarnation)) in enumerate(zip(groups, found)):
            rows = table[i * n:(i + 1) * n]
            rows[:, 0], rows[:, 1], rows[:, 2] = rank, int(Tier.VLLM), g
            rows[:, 3], rows[:, 4], rows[:, 5] = block[:n], gen[:n], incarnation
        hit = QueryResult(tuple(keys[:n]), table, np.full(len(table), NO_LEASE, np.int64))
        return hit, evicted_next

    def _unseen_by_the_launch(self, first: np.ndarray) -> bool:
        """Whether the mapped indexes are the whole launch's, all open, and this rank's
        own name the block ``first`` nowhere (the peers' were probed by :meth:`find`)."""
        if not self.whole_launch or (not self._tables and not self._own):
            return False
        if not all(ix.is_open for ix in (*self._tables.values(), *self._own.values())):
            return False  # an engine went: its successor's index is not mapped yet
        if set(self.ranks) != {r for r, _ in self._tables}:
            return False
        for g in self._shards.directory_groups:
            index = self._own.get((self._own_rank, self._shards.tp_rank(g)))
            if index is not None and index.find(g, first)[2][0]:
                return False
        return True

    def holding(self, rows: Sequence[Tuple[int, int, int]]) -> PeerHolding:
        """For each ``(kv group, name, block)`` (the step's victims): whether one same-host
        peer holds the block in its vLLM cache now, in every TP shard, and whether one
        held it now or once (an entry names it in a shard's index; its block handed out
        since).  A peer's copy outlives the one handed out here: the last holder on the
        host finds no other when it hands its copy out, and may save it (as
        ``xavier_save_victims`` says; two holders handing theirs out at once both see the
        other's generation bumped first: both may save)."""
        now, ever = np.zeros(len(rows), bool), np.zeros(len(rows), bool)
        if not len(rows) or not self._tables:
            return PeerHolding(now, ever)
        kv_groups = np.fromiter((g for g, _, _ in rows), np.int64, len(rows))
        words = name_words([name for _, name, _ in rows])
        by_group = [(g, np.flatnonzero(kv_groups == g)) for g in np.unique(kv_groups).tolist()]
        for rank in self.ranks:
            by_rank = np.ones(len(rows), bool)
            for g, at in by_group:
                for tp in range(self._shards.tp_size):
                    block, _, seen = self._lookup(rank, self._shards.directory_group(g, tp),
                                                  words[at])
                    by_rank[at] &= block >= 0
                    ever[at] |= seen
            now |= by_rank
        return PeerHolding(now, ever)

    def _lookup(self, rank: int, group: int, words: np.ndarray
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._tables[(rank, self._shards.tp_rank(group))].find(group, words)

    def close(self) -> None:
        for index in (*self._tables.values(), *self._own.values()):
            index.close()
        self._tables.clear()
        self._own.clear()
