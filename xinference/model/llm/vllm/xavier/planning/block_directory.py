"""The block directory (pure): where each KV block lives, and leases on it.

Hosted by ``VLLMBlockTracker`` in the supervisor pool, one per model; every operation is
synchronous and runs to completion inside the actor: each is atomic.

* Blocks are named by ``(group, key)``: the KV-cache group and the block's full name
  (:func:`~.block_names.block_name`, 192 bits of vLLM's block hash).  A query finds a
  block only under exactly its name; another name with the same low 63 bits (what a load
  row carries) is counted in ``identity_mismatches``: a collision is a miss, never a load.
* A **location** is ``(rank, tier, group, slot, generation, incarnation)``: the slot of a
  rank's tier storage for that group that holds the block.  ``generation`` changes whenever
  the storage reuses a slot (an older one is never returned or leased: a stale entry);
  ``incarnation`` names the storage that wrote it
  (:mod:`~..mechanism.slot_generations`: minted per storage), so that a restarted source's
  slots are another storage's, whatever their numbers.  None of this is trusted for the
  bytes: a loader checks the identity against the source's own generations after its copy
  (``doc/validated-reads.md``); the directory's bookkeeping only keeps such misses rare.
* :meth:`BlockDirectory.register` records blocks a rank has written and fenced.
* :meth:`BlockDirectory.query` returns the longest prefix of a request's keys that OTHER
  ranks hold, choosing one source per key (device memory first, then the least-leased),
  and takes a lease on every returned slot of Xavier's own tiers -- unless asked not to
  (``lease=False``: the connector's lookups; the loader leases what it reads once vLLM
  allocated the destinations, :meth:`BlockDirectory.lease`).  A location in a rank's own
  vLLM cache (``Tier.VLLM``, read in place) gets none (:data:`~.load_batch.NO_LEASE`): vLLM
  reuses its blocks without asking anyone; the reader's check after its copy makes such a
  read safe.
* :meth:`BlockDirectory.forget` drops the entries of slots a rank handed out, older than
  the generation it names.  :meth:`BlockDirectory.claim` is how a storage evicts: it
  proposes slots to reuse, the directory removes the unleased ones (never returned again)
  and refuses the leased ones: a slot under lease is never reused, and a query never
  returns a slot being reused.
* :meth:`BlockDirectory.unregister_rank` purges a rank: the leases on its slots die (a
  load from a dead rank fails and vLLM recomputes), and so do the leases it holds on other
  ranks' slots (a dead loader no longer pins them).
* A lease records its holder (the querying rank) and expires after ``lease_ttl_s``: a
  claim or a query near ``max_leases`` first drops the expired ones (``leases_expired``);
  a holder that loads later may find the slot reused, and its check after the copy
  (``doc/validated-reads.md``) fails the read: a miss, never wrong KV.
* Lease ids are random (:mod:`.directory_leases`): none is freed by guessing its id, nor
  by a late release from before the directory was re-created.

Memory is bounded by the registered slots (one int per slot, :mod:`.directory_entries`,
under its place and its short name), what a departed rank left (swept
:data:`SWEEP_PER_CALL` per call) and ``max_leases``.  A rank unregistered or a tier
forgotten loses its places at once (its entries: garbage every lookup skips).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from . import directory_entries as ent
from .block_names import ROW_KEY_MASK
from .directory_entries import DirectoryError
from .directory_leases import Leases
from .directory_types import DirectoryStats, Location, QueryResult
from .load_batch import NO_LEASE, Tier, read_preference

#: no holder named (a query without ``exclude_rank``)
NO_HOLDER = -1
#: how long a lease holds a slot unless released: longer than a request waits in vLLM's
#: queue between its lookup and its load in any run measured here (seconds at C32)
LEASE_TTL_S = 120.0
#: entries a departed rank left that each call removes from their records (a few ms)
SWEEP_PER_CALL = 4096
#: valid copies of one block a query weighs (device copies come first in a record): with
#: 64 holders leased alike, the cost of a lookup stays that of a few
CANDIDATES_PER_BLOCK = 4
_EMPTY: Dict[int, int] = {}
_TIERS = frozenset(int(t) for t in Tier)
_VLLM = int(Tier.VLLM)
_PLACE_TIER, _PLACE_GROUP = ent.PLACE_TIER_SHIFT, ent.PLACE_GROUP_SHIFT
#: read_preference by tier, looked up without a call (the lookup loop)
_PREFERENCE = tuple(read_preference(t) for t in range(max(_TIERS) + 1))


@dataclass
class BlockDirectory:
    """Which rank holds which block, in which tier and slot; leases that keep a slot from
    being reused while a load reads it (paired: granted by ``query*``, given back by
    ``release``; a rank's leases go with the rank).  Pure; the supervisor's
    ``VLLMBlockTracker`` actor wraps it."""
    max_leases: int = 1_000_000
    lease_ttl_s: float = LEASE_TTL_S
    clock: Callable[[], float] = time.monotonic
    #: short name -> its record (:mod:`.directory_entries`)
    _records: Dict[int, ent.Record] = field(default_factory=dict)
    #: rank -> place -> the entry there (the truth: any other entry is garbage)
    _places: Dict[int, Dict[int, int]] = field(default_factory=dict)
    #: entries dropped with their rank or tier, still in records (swept a bit per call)
    _garbage: Deque[List[int]] = field(default_factory=collections.deque)
    _ranks: Set[int] = field(default_factory=set)
    #: rank -> place -> the generation it had when forgotten (older registrations refused)
    _floors: Dict[int, Dict[int, int]] = field(default_factory=dict)
    #: rank -> its engine's tensor-parallel degree (given at register_rank)
    _tp_sizes: Dict[int, int] = field(default_factory=dict)
    stats: DirectoryStats = field(default_factory=DirectoryStats)
    _leases: Leases = field(init=False)

    def __post_init__(self) -> None:
        self._leases = Leases(self.max_leases, self.lease_ttl_s, self.clock, self.stats)

    # ---------------------------------------------------------------- ranks
    def register_rank(self, rank: int, tp_size: int = 1) -> None:
        """``rank``'s engine joins; ``tp_size``: its tensor-parallel degree.  The ranks of one
        directory share one degree (a directory group names a shard, :mod:`.shards`): a
        rank of another degree than the ranks registered is refused, naming it."""
        ent.check_int("rank", rank)
        others = {tp for r, tp in self._tp_sizes.items() if r != rank}
        if others and tp_size not in others:
            raise DirectoryError(
                f"tensor_parallel_size: rank {rank} runs {tp_size}, the other replicas of the "
                f"launch {sorted(others)[0]}; replicas of different tensor-parallel degrees "
                "cannot share KV (each worker holds another shard of the heads)")
        self._ranks.add(rank)
        self._tp_sizes[rank] = tp_size

    def unregister_rank(self, rank: int) -> int:
        """Forget every block and lease of ``rank``; returns the blocks dropped.  Its places
        go at once (its entries are then garbage that no lookup returns), its entries leave
        their records a few thousand per later call (:meth:`sweep`)."""
        self._ranks.discard(rank)
        self._tp_sizes.pop(rank, None)
        places = self._places.pop(rank, _EMPTY)
        self._floors.pop(rank, None)
        if places:
            self._garbage.append(list(places.values()))
        self._leases.drop_rank(rank)
        self.sweep()
        return len(places)

    def sweep(self, budget: int = SWEEP_PER_CALL) -> int:
        """Remove up to ``budget`` garbage entries from their records (every mutating call
        and every query does; ``budget`` < 0: all); returns how many were removed."""
        done = 0
        while self._garbage and (budget < 0 or done < budget):
            batch = self._garbage[-1]
            while batch and (budget < 0 or done < budget):
                entry = batch.pop()
                if self._places.get(ent.rank_of(entry), _EMPTY).get(
                        ent.place_of(entry)) is not entry:
                    self._unlink(entry)
                done += 1
            if not batch:
                self._garbage.pop()
        return done

    # -------------------------------------------------------------- blocks
    def register(self, rank: int, entries: Iterable[Tuple[int, int, int, int, int]],
                 incarnation: int = 0) -> int:
        """Record ``(group, key, tier, slot, generation)`` blocks written and fenced on
        ``rank`` by its storage ``incarnation``.  Within one incarnation a slot's newer
        generation replaces the older entry and an older one is ignored (counted as
        stale).  An entry of another incarnation than the slot's is replaced whatever its
        generation (the newest registration wins: a restarted source numbers its slots
        anew, without claiming them here; if a dead storage's late registration wins
        instead, its reads fail the loader's check and miss).  Returns how many entries
        were recorded."""
        ent.check_int("rank", rank, ent.LIMITS["rank"])
        ent.check_int("incarnation", incarnation, ent.LIMITS["incarnation"])
        self.sweep()
        self._ranks.add(rank)
        places = self._places.setdefault(rank, {})
        floors = self._floors.get(rank, _EMPTY)
        recorded = 0
        limits = ent.LIMITS
        g_max, k_max, s_max, n_max = (limits["group"], limits["key"], limits["slot"],
                                      limits["generation"])
        records, rank_bits = self._records, rank << ent.RANK_SHIFT
        for group, key, tier, slot, gen in entries:
            if not (type(group) is int and type(key) is int and type(slot) is int
                    and type(gen) is int and type(tier) is int
                    and 0 <= group <= g_max and 0 <= key <= k_max
                    and tier in _TIERS and 0 <= slot <= s_max and 0 <= gen <= n_max):
                ent.check_entry(group, key, tier, slot, gen)  # (one call per entry cost ~25 %)
            # (packed inline, as ent.place / ent.short_name / ent.pack do: calls cost ~30 %)
            where = (tier << _PLACE_TIER) | (group << _PLACE_GROUP) | slot
            if gen < floors.get(where, 0):  # forgotten at a newer generation already
                self.stats.stale_registrations += 1
                continue
            prev = places.get(where)
            if prev is not None:
                prev_key = ent.name_of(prev)
                prev_gen, prev_inc = ent.identity_of(prev)
                same = prev_inc == incarnation
                if same and (gen < prev_gen or (gen == prev_gen and prev_key != key)):
                    self.stats.stale_registrations += 1
                    continue
                if (prev_key, prev_gen, prev_inc) == (key, gen, incarnation):
                    recorded += 1
                    continue
                if same and self._leases.on((rank, where)):
                    raise DirectoryError(
                        f"slot: rank {rank} tier {tier} slot {slot} is leased; it was "
                        "reused without claim()")
                del places[where]
                self._unlink(prev)
            short = ((key & ROW_KEY_MASK) << 16) | group
            record = records.get(short)
            entry = ((key << ent.NAME_SHIFT) | rank_bits | (where << ent.PLACE_SHIFT)
                     | (gen << ent.GEN_SHIFT) | incarnation)
            if record is None:
                records[short] = entry
            else:
                for other in ent.entries(record):  # one location per (key, rank): the
                    # newest registration wins (a demoted block is registered in the CPU
                    # tier before its GPU slot is claimed)
                    if ent.rank_of(other) == rank and ent.name_of(other) == key:
                        record = ent.without_entry(record, other)  # type: ignore[arg-type]
                        if places.get(ent.place_of(other)) is other:
                            del places[ent.place_of(other)]
                records[short] = ent.with_entry(record, entry, _PREFERENCE[tier] == 0)
            places[where] = entry
            recorded += 1
        self.stats.registered += recorded
        return recorded

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        """The storage of ``rank``/``tier``/``group`` wants to reuse ``slots``: returns those
        it may reuse (now unregistered); leased slots are refused and stay registered
        (expired leases are dropped first)."""
        self.sweep()
        self._leases.expire()
        places = self._places.get(rank, _EMPTY)
        granted = []
        for slot in ent.checked_places(tier, group, slots):
            where = ent.place(tier, group, slot)
            if self._leases.on((rank, where)):
                self.stats.claims_refused += 1
                continue
            prev = places.pop(where, None)
            if prev is not None:
                self._unlink(prev)
            granted.append(slot)
        return granted

    def forget(self, rank: int, tier: int,
               slots: Optional[Mapping[int, Sequence[Tuple[int, int]]]] = None,
               groups: Optional[Sequence[int]] = None) -> int:
        """``rank`` no longer holds ``slots`` (group -> ``(slot, generation now)``) of ``tier``
        (None: any slot of it, of ``groups`` if given, dropped at once): their entries go,
        leased or not (vLLM never asks a lease); a registration of an older generation of
        such a slot, arriving late, is refused as stale, and one of that generation or newer
        that came first (the block vLLM computed there since) is kept; returns how many went."""
        self.sweep()
        places = self._places.get(rank, _EMPTY)
        if slots is None:
            mine = [p for p in places if ent.tier_of_place(p) == tier and (
                groups is None or (p >> _PLACE_GROUP) & 0xFFFF in groups)]
            self._garbage.append([places.pop(p) for p in mine])
            self.stats.forgotten += len(mine)
            return len(mine)
        floors, records = self._floors.setdefault(rank, {}), self._records
        dropped = 0
        for group, group_slots in slots.items():
            checked = ent.checked_places(tier, group, [slot for slot, _ in group_slots])
            bits = (int(tier) << _PLACE_TIER) | (int(group) << _PLACE_GROUP)
            for slot, (_, gen) in zip(checked, group_slots):
                where = bits | slot
                prev = places.get(where)
                if gen:
                    floors[where] = max(int(gen), floors.get(where, 0))
                    if prev is not None and ent.identity_of(prev)[0] >= gen:
                        continue  # the new block, registered before this (late) forget
                if prev is not None:
                    del places[where]
                    short = (((prev >> ent.NAME_SHIFT) & ROW_KEY_MASK) << 16) | int(group)
                    if records.get(short) is prev:  # (its only copy: unlinked inline)
                        del records[short]
                    else:
                        self._unlink(prev)
                    dropped += 1
        self.stats.forgotten += dropped
        return dropped

    def move(self, rank: int, entries: Iterable[Tuple[int, int, int, int, int]], tier: int,
             group: int, slots: Sequence[int], incarnation: int = 0) -> List[int]:
        """A demotion in one atomic step: :meth:`register` the lower copies ``entries``,
        then :meth:`claim` ``slots`` of ``tier``/``group`` (returns the granted ones)."""
        self.register(rank, entries, incarnation)
        return self.claim(rank, tier, group, slots)

    def query(self, group: int, keys: Sequence[int],
              exclude_rank: Optional[int] = None, lease: bool = True) -> QueryResult:
        """Longest prefix of ``keys`` of ``group`` held by ranks other than ``exclude_rank``,
        leased (``lease``; else every lease id is ``NO_LEASE``: the loader takes its leases
        when it allocates the destinations, :meth:`lease`).  Of a block's copies it offers
        device memory before host memory, then the least leased, among the first
        :data:`CANDIDATES_PER_BLOCK` valid ones."""
        self.sweep()
        self.stats.queries += 1
        chosen: List[int] = []
        records, places = self._records, self._places
        for key in keys:
            record = records.get(((key & ROW_KEY_MASK) << 16) | group)
            if record is None:
                break
            # inline, the common case: a first copy _best_copy would return at once
            first = record if isinstance(record, int) else record[0]
            rank = (first >> ent.RANK_SHIFT) & 0xFFFF
            if (first >> ent.NAME_SHIFT == key and rank != exclude_rank
                    and (first >> ent.TIER_SHIFT) & 0xFF == _VLLM
                    and places.get(rank, _EMPTY).get((first >> ent.PLACE_SHIFT)
                                                     & ent.PLACE_MASK) is first):
                chosen.append(first)
                continue
            best = self._best_copy(group, key, exclude_rank, record)
            if best is None:
                break
            chosen.append(best)
        held = [(ent.rank_of(e), ent.place_of(e)) for e in chosen
                if ent.tier_of(e) != Tier.VLLM] if lease else []
        if not self._leases.room_for(len(held)):
            chosen = []  # refuse rather than grow without bound: a miss is always safe
        if not chosen:
            self.stats.missed_queries += 1
            return QueryResult((), (), ())
        ids = iter(self._leases.grant(held, NO_HOLDER if exclude_rank is None else exclude_rank))
        lease_ids = [NO_LEASE if not lease or ent.tier_of(e) == Tier.VLLM else next(ids)
                     for e in chosen]
        self.stats.hit_blocks += len(chosen)
        return QueryResult(tuple(keys[:len(chosen)]), ent.location_table(chosen), lease_ids)

    def _best_copy(self, group: int, key: int, exclude_rank: Optional[int],
                   record: ent.Record) -> Optional[int]:
        """The entry of ``key``'s copy a query offers from ``record`` (its short name's),
        None if no other rank holds it (only other names there: a mismatch, counted).
        Device memory first, then the least leased (:data:`CANDIDATES_PER_BLOCK` weighed)."""
        places, counts = self._places, self._leases.counts
        best: Optional[int] = None
        best_pref, seen, named = (2, 0), 0, False
        for entry in ent.entries(record):
            if entry >> ent.NAME_SHIFT != key:
                continue
            named = True
            rank = (entry >> ent.RANK_SHIFT) & 0xFFFF
            where = (entry >> ent.PLACE_SHIFT) & ent.PLACE_MASK
            if rank == exclude_rank or places.get(rank, _EMPTY).get(where) is not entry:
                continue  # (its rank gone, its slot reused: garbage)
            tier = (entry >> ent.TIER_SHIFT) & 0xFF
            if tier == Tier.VLLM:
                return entry  # device memory, never leased: none is preferred to it
            pref = (_PREFERENCE[tier], counts.get((rank, where), 0))
            if best is None or pref < best_pref:
                best, best_pref = entry, pref
                if pref == (0, 0):
                    break
            seen += 1
            if seen >= CANDIDATES_PER_BLOCK:
                break
        if not named:
            self.stats.identity_mismatches += 1
        return best

    def lease(self, holder: int, locations: Sequence[Location]) -> List[int]:
        """Leases for ``holder``'s load of ``locations`` (taken when its destinations are
        allocated, released when the load is done): one id per location.  ``NO_LEASE`` for
        a location read in place, for one whose slot no longer holds what it names (the
        read fails its check anyway), and for all when the lease bound is reached even
        after expiry (then unprotected reads: still checked, at worst recomputed)."""
        ent.check_int("holder", holder)
        live = [self._names_its_slot(loc) for loc in locations]
        if not self._leases.room_for(sum(live)):
            self.stats.leases_refused += sum(live)
            return [NO_LEASE] * len(locations)
        granted = iter(self._leases.grant([(loc.rank, ent.place(loc.tier, loc.group, loc.slot))
                                           for loc, ok in zip(locations, live) if ok], holder))
        return [next(granted) if ok else NO_LEASE for ok in live]

    def _names_its_slot(self, loc: Location) -> bool:
        """``loc`` is of Xavier's tiers and its slot still holds what it names."""
        if loc.tier == Tier.VLLM:
            return False
        held = self._places.get(loc.rank, _EMPTY).get(ent.place(loc.tier, loc.group, loc.slot))
        return held is not None and ent.identity_of(held) == (loc.generation, loc.incarnation)

    def query_prefix(self, groups: Sequence[int], keys: Sequence[int],
                     exclude_rank: Optional[int] = None, lease: bool = True) -> QueryResult:
        """The longest prefix of ``keys`` held by other ranks in EVERY group of ``groups``
        (a hybrid model needs each group's block of a position), leased.  Locations and
        lease ids are group-major: group ``groups[g]``'s ``j``-th block is at
        ``g * num_hits + j``.  The leases beyond the common prefix are given back here."""
        if not groups:
            raise DirectoryError("groups: at least one KV-cache group")
        results = [self.query(groups[0], keys, exclude_rank, lease)]
        for group in groups[1:]:
            results.append(self.query(group, keys[:results[0].num_hits], exclude_rank, lease))
        n = min(r.num_hits for r in results)
        extra = [lid for r in results for lid in r.lease_ids[n:]]
        if extra:
            self.release(extra)
        if len(results) == 1:  # (as arrays: no tuple per block)
            return results[0]
        return QueryResult(tuple(keys[:n]), np.concatenate([r.table[:n] for r in results]),
                           np.concatenate([r.lease_table[:n] for r in results]))

    def query_many(self, groups: Sequence[int], requests: Sequence[Sequence[int]],
                   exclude_rank: Optional[int] = None, lease: bool = True
                   ) -> List[QueryResult]:
        """:meth:`query_prefix` for each request's keys (a step's new requests, one call)."""
        return [self.query_prefix(groups, keys, exclude_rank, lease) for keys in requests]

    def release(self, lease_ids: Iterable[int]) -> int:
        """Release leases (unknown ids: counted, not errors); returns how many were."""
        return self._leases.release(lease_ids)

    def expire_leases(self) -> int:
        """Drop the leases older than ``lease_ttl_s``; returns how many went."""
        return self._leases.expire()

    # --------------------------------------------------------------- views
    @property
    def ranks(self) -> Set[int]:
        """The ranks registered now."""
        return set(self._ranks)

    @property
    def num_blocks(self) -> int:
        return sum(len(places) for places in self._places.values())

    @property
    def num_keys(self) -> int:
        """Block names held (after a bounded sweep: a departed rank's names count until
        swept; names equal in their low 63 bits count once)."""
        self.sweep()
        return len(self._records)

    @property
    def outstanding_leases(self) -> int:
        return len(self._leases)

    def leased(self, rank: int, tier: int, group: int, slot: int) -> int:
        return self._leases.on((rank, ent.place(tier, group, slot)))

    def _unlink(self, entry: int) -> None:
        """Take ``entry`` out of its record."""
        short = ent.short_name(ent.name_of(entry), ent.group_of(entry))
        record = self._records.get(short)
        if record is None:
            return
        left = ent.without_entry(record, entry)
        if left is None:
            del self._records[short]
        elif left is not record:
            self._records[short] = left
