"""The block directory (pure): where each KV block lives, and leases on it.

Hosted by ``VLLMBlockTracker`` in the supervisor pool; one instance per model.
Every operation is synchronous and runs to completion inside the actor, so
each one is atomic with respect to the others.

* Blocks are named by ``(group, key)``: the KV-cache group and the block's full name
  (:func:`~.block_names.block_name`, 192 bits of vLLM's block hash; hybrid models hash
  the same tokens alike in every group).  A query finds a block only under exactly its
  name; one that finds only another name with the same low 63 bits (what a load row
  carries) is counted in ``identity_mismatches``: a forged or accidental collision of the
  short key is a miss, never a load.
* A **location** is ``(rank, tier, group, slot, generation, incarnation)``: the slot of a
  rank's tier storage for that group that holds the block.  ``generation`` changes whenever the
  storage reuses a slot, so an entry for an older generation is never
  returned or leased (a stale entry); ``incarnation`` names the storage that wrote it
  (:mod:`~..mechanism.slot_generations`: minted per storage), so that a restarted source's
  slots are another storage's, whatever their numbers.  None of this is trusted for the
  bytes: a loader checks the identity against the source's own generations after its copy
  (``doc/validated-reads.md``); the directory's bookkeeping only keeps such misses rare.
* :meth:`BlockDirectory.register` records blocks a rank has written and fenced.
* :meth:`BlockDirectory.query` returns the longest prefix of a request's keys
  that OTHER ranks hold, choosing one source per key (device memory first, then the
  least-leased), and takes a lease on every returned slot of Xavier's own tiers -- unless
  asked not to (``lease=False``: the connector's lookups); then the loader leases what it
  reads once vLLM allocated the destinations (:meth:`BlockDirectory.lease`).  A
  location in a rank's own vLLM cache (``Tier.VLLM``, read in place) gets none
  (:data:`~.load_batch.NO_LEASE`): vLLM reuses its blocks without asking anyone, and the
  reader's check after its copy is what makes such a read safe.
* :meth:`BlockDirectory.forget` drops locations a rank no longer holds (vLLM handed those
  blocks out to be overwritten), whatever their generation.
* :meth:`BlockDirectory.claim` is how a storage evicts: it proposes slots to
  reuse, the directory removes the unleased ones (so they can no longer be
  returned) and refuses the leased ones.  So a slot under lease is never
  reused, and a query never returns a slot being reused.
* :meth:`BlockDirectory.unregister_rank` purges a rank: the leases on its slots die (a
  load from a dead rank fails and vLLM recomputes), and so do the leases it holds on other
  ranks' slots (a dead loader no longer pins them).
* A lease records its holder (the querying rank) and expires after ``lease_ttl_s``: a
  claim or a query near ``max_leases`` first drops the expired ones (``leases_expired``).
  A holder that loads after its lease expired may find the slot reused; its check after
  the copy (``doc/validated-reads.md``) then fails the read: a miss, never wrong KV.
* Lease ids are unique across directory incarnations (:func:`fresh_lease_ids`): a late
  release from before a directory was re-created frees nothing of the new one's.

Memory is bounded by the number of registered slots (one key per slot, one
location per (key, rank)); ``max_leases`` bounds outstanding leases.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import (
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from .block_names import row_key
from .directory_types import (
    DirectoryStats,
    LeaseRecord,
    Location,
    QueryResult,
    SlotId,
    fresh_lease_ids,
)
from .load_batch import NO_LEASE, Tier, read_preference

BlockId = Tuple[int, int]  # (group, key)
#: no holder named (a query without ``exclude_rank``)
NO_HOLDER = -1
#: how long a lease holds a slot unless released: longer than a request waits in vLLM's
#: queue between its lookup and its load in any run measured here (seconds at C32)
LEASE_TTL_S = 120.0


class DirectoryError(ValueError):
    """Bad input to the directory; the message names the field."""


@dataclass
class BlockDirectory:
    """Which rank holds which block, in which tier and slot; leases that keep a slot from
    being reused while a load reads it (paired: granted by ``query*``, given back by
    ``release``; a rank's leases go with the rank).  Pure; the supervisor's
    ``VLLMBlockTracker`` actor wraps it."""
    max_leases: int = 1_000_000
    lease_ttl_s: float = LEASE_TTL_S
    clock: Callable[[], float] = time.monotonic
    _by_key: Dict[BlockId, Dict[int, Location]] = field(default_factory=dict)
    #: -> (key, generation, incarnation)
    _by_slot: Dict[SlotId, Tuple[int, int, int]] = field(default_factory=dict)
    #: (group, low 63 bits of a key) -> a key registered with them (only to count
    #: ``identity_mismatches``; lookups go by the full key)
    _short: Dict[BlockId, int] = field(default_factory=dict)
    #: lease id -> its record, in the order granted (ids grow): the oldest come first
    _leases: Dict[int, LeaseRecord] = field(default_factory=dict)
    _lease_count: Dict[SlotId, int] = field(default_factory=dict)
    _ranks: Set[int] = field(default_factory=set)
    #: slot -> the generation it had when its rank forgot it (older registrations refused)
    _floors: Dict[SlotId, int] = field(default_factory=dict)
    #: rank -> its engine's tensor-parallel degree (given at register_rank)
    _tp_sizes: Dict[int, int] = field(default_factory=dict)
    #: lease ids: unique across directory incarnations (a re-created directory must not
    #: hand out an id that an old incarnation's reader may still release late)
    _ids: itertools.count[int] = field(default_factory=fresh_lease_ids)
    stats: DirectoryStats = field(default_factory=DirectoryStats)

    # ---------------------------------------------------------------- ranks
    def register_rank(self, rank: int, tp_size: int = 1) -> None:
        """``rank``'s engine joins; ``tp_size``: its tensor-parallel degree.  The ranks of one
        directory share one degree (a directory group names a shard, :mod:`.shards`): a
        rank of another degree than the ranks registered is refused, naming it."""
        _check_int("rank", rank)
        others = {tp for r, tp in self._tp_sizes.items() if r != rank}
        if others and tp_size not in others:
            raise DirectoryError(
                f"tensor_parallel_size: rank {rank} runs {tp_size}, the other replicas of the "
                f"launch {sorted(others)[0]}; replicas of different tensor-parallel degrees "
                "cannot share KV (each worker holds another shard of the heads)")
        self._ranks.add(rank)
        self._tp_sizes[rank] = tp_size

    def unregister_rank(self, rank: int) -> int:
        """Forget every block and lease of ``rank``; returns the blocks dropped."""
        self._ranks.discard(rank)
        self._tp_sizes.pop(rank, None)
        slots = [s for s in self._by_slot if s[0] == rank]
        for s in slots:
            key = self._by_slot.pop(s)[0]
            self._unlink((s[2], key), rank, s)
        for lease_id in [i for i, s in self._leases.items() if s.slot[0] == rank]:
            del self._leases[lease_id]
        for s in [s for s in self._lease_count if s[0] == rank]:
            del self._lease_count[s]
        for s in [s for s in self._floors if s[0] == rank]:
            del self._floors[s]
        held = [i for i, s in self._leases.items() if s.holder == rank]
        self._drop_leases(held)
        self.stats.leases_of_gone_holders += len(held)
        return len(slots)

    # -------------------------------------------------------------- blocks
    def register(self, rank: int, entries: Iterable[Tuple[int, int, int, int, int]],
                 incarnation: int = 0) -> int:
        """Record ``(group, key, tier, slot, generation)`` blocks written and fenced on
        ``rank`` by its storage ``incarnation``.

        Within one incarnation a slot's newer generation replaces the older entry and an
        older one is ignored (counted as stale).  An entry of another incarnation than the
        slot's is replaced whatever its generation (the newest registration wins: a
        restarted source numbers its slots anew, without claiming them here; if a dead
        storage's late registration wins instead, its reads fail the loader's check and
        miss).  Returns how many entries were recorded.
        """
        _check_int("rank", rank)
        _check_int("incarnation", incarnation)
        self._ranks.add(rank)
        recorded = 0
        for group, key, tier, slot, gen in entries:
            _check_int("group", group)
            _check_int("key", key)
            Tier(_check_int("tier", tier))
            _check_int("slot", slot)
            _check_int("generation", gen)
            sid = (rank, tier, group, slot)
            if gen < self._floors.get(sid, 0):  # forgotten at a newer generation already
                self.stats.stale_registrations += 1
                continue
            prev = self._by_slot.get(sid)
            if prev is not None:
                prev_key, prev_gen, prev_inc = prev
                same = prev_inc == incarnation
                if same and (gen < prev_gen or (gen == prev_gen and prev_key != key)):
                    self.stats.stale_registrations += 1
                    continue
                if (prev_key, prev_gen, prev_inc) != (key, gen, incarnation):
                    if same and self._lease_count.get(sid):
                        raise DirectoryError(
                            f"slot: rank {rank} tier {tier} slot {slot} is leased; it was "
                            "reused without claim()")
                    self._unlink((group, prev_key), rank, sid)
            old = self._by_key.get((group, key), {}).get(rank)
            if old is not None and _sid(old) != sid:
                # one location per (key, rank): the newest registration wins (a block
                # demoted to the CPU tier is registered there before its GPU slot is claimed)
                self._by_slot.pop(_sid(old), None)
            self._by_slot[sid] = (key, gen, incarnation)
            if (group, key) not in self._by_key:
                self._short[(group, row_key(key))] = key
            self._by_key.setdefault((group, key), {})[rank] = Location(
                rank, tier, group, slot, gen, incarnation)
            recorded += 1
        self.stats.registered += recorded
        return recorded

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        """The storage of ``rank``/``tier``/``group`` wants to reuse ``slots``: returns those
        it may reuse (now unregistered); leased slots are refused and stay registered
        (expired leases are dropped first)."""
        self.expire_leases()
        granted = []
        for slot in slots:
            sid = (rank, tier, group, slot)
            if self._lease_count.get(sid):
                self.stats.claims_refused += 1
                continue
            prev = self._by_slot.pop(sid, None)
            if prev is not None:
                self._unlink((group, prev[0]), rank, sid)
            granted.append(slot)
        return granted

    def forget(self, rank: int, tier: int,
               slots: Optional[Mapping[int, Sequence[Tuple[int, int]]]] = None) -> int:
        """``rank`` no longer holds ``slots`` (group -> ``(slot, generation now)``) of ``tier``
        (None: any slot of it): their entries go, leased or not (vLLM's cache read in place:
        a lease never stopped vLLM); a registration of an older generation of such a slot,
        arriving late, is refused as stale.  Returns the entries dropped."""
        if slots is None:
            mine: Dict[int, List[Tuple[int, int]]] = {}
            for r, t, g, s in self._by_slot:
                if (r, t) == (rank, tier):
                    mine.setdefault(g, []).append((s, 0))
            slots = mine
        dropped = 0
        for group, group_slots in slots.items():
            for slot, gen in group_slots:
                sid = (rank, int(tier), int(group), int(slot))
                if gen:
                    self._floors[sid] = int(gen)
                prev = self._by_slot.pop(sid, None)
                if prev is not None:
                    self._unlink((int(group), prev[0]), rank, sid)
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
        when it allocates the destinations, :meth:`lease`)."""
        self.stats.queries += 1
        hit_keys: List[int] = []
        locs: List[Location] = []
        for key in keys:
            best: Optional[Location] = None
            best_pref = (2, 0)
            for loc in self._by_key.get((group, key), {}).values():
                if loc.rank == exclude_rank or loc.rank not in self._ranks:
                    continue
                pref = _preference(loc, self._lease_count)
                if best is None or pref < best_pref:
                    best, best_pref = loc, pref
                    if pref == (0, 0):  # device memory, unleased: none is preferred to it
                        break
            if best is None:
                if (group, key) not in self._by_key and self._short.get(
                        (group, row_key(key)), key) != key:
                    self.stats.identity_mismatches += 1
                break
            hit_keys.append(key)
            locs.append(best)
        leased = sum(1 for loc in locs if loc.tier != Tier.VLLM) if lease else 0
        if not self._room_for_leases(leased):
            # refuse rather than grow without bound: a miss is always safe
            hit_keys, locs = [], []
        holder = NO_HOLDER if exclude_rank is None else exclude_rank
        lease_ids = self._grant(locs, holder) if lease else [NO_LEASE] * len(locs)
        if not locs:
            self.stats.missed_queries += 1
        self.stats.hit_blocks += len(locs)
        return QueryResult(tuple(hit_keys), tuple(locs), tuple(lease_ids))

    def lease(self, holder: int, locations: Sequence[Location]) -> List[int]:
        """Leases for ``holder``'s load of ``locations`` (taken when its destination blocks
        are allocated, released when the load is done): one id per location, in order.
        ``NO_LEASE`` for a location read in place (no lease needed), for one whose slot no
        longer holds what it names (its rank gone, the slot forgotten or reused: the read
        fails its check anyway), and for all of them when the lease bound is reached even
        after expiry (the reads are then unprotected: still checked, at worst recomputed)."""
        _check_int("holder", holder)
        live = [self._names_its_slot(loc) for loc in locations]
        if not self._room_for_leases(sum(live)):
            self.stats.leases_refused += sum(live)
            return [NO_LEASE] * len(locations)
        granted = iter(self._grant([loc for loc, ok in zip(locations, live) if ok], holder))
        return [next(granted) if ok else NO_LEASE for ok in live]

    def _names_its_slot(self, loc: Location) -> bool:
        """``loc`` is of Xavier's tiers and its slot still holds what it names."""
        if loc.tier == Tier.VLLM or loc.rank not in self._ranks:
            return False
        held = self._by_slot.get(_sid(loc))
        return held is not None and held[1:] == (loc.generation, loc.incarnation)

    def _room_for_leases(self, n: int) -> bool:
        """Whether ``n`` more leases fit under ``max_leases`` (expired ones dropped first)."""
        if n and len(self._leases) + n > self.max_leases:
            self.expire_leases()
        return not n or len(self._leases) + n <= self.max_leases

    def _grant(self, locs: Sequence[Location], holder: int) -> List[int]:
        """A lease per location of Xavier's tiers, held by ``holder``; ``NO_LEASE`` for one
        read in place (checked after the copy, nothing of Xavier's reused under it)."""
        lease_ids = []
        now = self.clock() if locs else 0.0
        for loc in locs:
            if loc.tier == Tier.VLLM:
                lease_ids.append(NO_LEASE)
                continue
            lease_id = next(self._ids)
            sid = _sid(loc)
            self._leases[lease_id] = LeaseRecord(sid, holder, now)
            self._lease_count[sid] = self._lease_count.get(sid, 0) + 1
            lease_ids.append(lease_id)
        self.stats.leases_granted += sum(1 for i in lease_ids if i != NO_LEASE)
        return lease_ids

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
        return QueryResult(tuple(keys[:n]),
                           tuple(loc for r in results for loc in r.locations[:n]),
                           tuple(lid for r in results for lid in r.lease_ids[:n]))

    def query_many(self, groups: Sequence[int], requests: Sequence[Sequence[int]],
                   exclude_rank: Optional[int] = None, lease: bool = True
                   ) -> List[QueryResult]:
        """:meth:`query_prefix` for each request's keys: a scheduler step's new requests
        in one call."""
        return [self.query_prefix(groups, keys, exclude_rank, lease) for keys in requests]

    def release(self, lease_ids: Iterable[int]) -> int:
        """Release leases; unknown ids (already released, purged rank) are counted, not errors.
        Returns how many were released."""
        released = 0
        for lease_id in lease_ids:
            if lease_id == NO_LEASE:  # a location read in place: nothing was leased
                continue
            if lease_id not in self._leases:
                self.stats.unknown_releases += 1
                continue
            self._drop_leases([lease_id])
            released += 1
        self.stats.leases_released += released
        return released

    def expire_leases(self) -> int:
        """Drop the leases older than ``lease_ttl_s`` (oldest first; stops at the first
        younger one); returns how many went."""
        deadline = self.clock() - self.lease_ttl_s
        old = list(itertools.takewhile(lambda i: self._leases[i].granted_at < deadline,
                                       self._leases))
        self._drop_leases(old)
        self.stats.leases_expired += len(old)
        return len(old)

    def _drop_leases(self, lease_ids: Iterable[int]) -> None:
        """Forget these (outstanding) leases and their holds on their slots."""
        for lease_id in lease_ids:
            sid = self._leases.pop(lease_id).slot
            left = self._lease_count[sid] - 1
            if left:
                self._lease_count[sid] = left
            else:
                del self._lease_count[sid]

    # --------------------------------------------------------------- views
    @property
    def ranks(self) -> Set[int]:
        """The ranks registered now."""
        return set(self._ranks)

    @property
    def num_blocks(self) -> int:
        return len(self._by_slot)

    @property
    def num_keys(self) -> int:
        return len(self._by_key)

    @property
    def outstanding_leases(self) -> int:
        return len(self._leases)

    def leased(self, rank: int, tier: int, group: int, slot: int) -> int:
        return self._lease_count.get((rank, tier, group, slot), 0)

    def _unlink(self, key: BlockId, rank: int, sid: SlotId) -> None:
        """Forget block ``key`` on ``rank`` if its location is ``sid``."""
        locs = self._by_key.get(key)
        if locs is None:
            return
        loc = locs.get(rank)
        if loc is not None and _sid(loc) == sid:
            del locs[rank]
            if not locs:
                del self._by_key[key]
                short = (key[0], row_key(key[1]))
                if self._short.get(short) == key[1]:
                    del self._short[short]


def _preference(loc: Location, lease_count: Dict[SlotId, int]) -> Tuple[int, int]:
    """Which of a block's copies a query offers (lower first): device memory before host
    memory (:func:`~.load_batch.read_preference`), then the less leased one."""
    return read_preference(loc.tier), lease_count.get(_sid(loc), 0)


def _sid(loc: Location) -> SlotId:
    return (loc.rank, loc.tier, loc.group, loc.slot)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DirectoryError(f"{name}: expected a non-negative int, got {value!r}")
    return value
