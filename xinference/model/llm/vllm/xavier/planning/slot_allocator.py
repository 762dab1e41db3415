"""LRU slot bookkeeping of one storage tier of one KV-cache group (pure).

The allocator knows which key each slot holds, the slot's generation (bumped
on every reuse) and the LRU order.  It does not know about leases: eviction
candidates are proposed to the block directory (``claim``), which refuses
leased slots; the storage then calls :meth:`SlotAllocator.assign` only for
granted slots.

The generations may live in memory that readers of other processes map (the storage's
``SlotGenerations`` file): :meth:`SlotAllocator.assign` bumps a slot's generation, and the
writer assigns a slot before it writes new bytes into it, so a reader that checks the
generation after its copy sees any write that overlapped it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Container, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np


class GenerationWords(Protocol):
    """One integer word per slot (a list, or a row of a shared file as numpy gives it)."""

    def __len__(self) -> int: ...
    def __getitem__(self, slot: int) -> Any: ...
    def __setitem__(self, slot: int, value: Any) -> None: ...


class SlotAllocator:
    """Slots of one storage tier and group: which key each holds, LRU order, generations;
    free slots taken in O(1).  ``generations``: where the generations live (one word per
    slot, e.g. a row of a shared ``SlotGenerations`` file; their values now are where they
    start); a private list of zeros by default."""
    def __init__(self, num_slots: int,
                 generations: Optional[GenerationWords] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: must be at least 1, got {num_slots}")
        if generations is not None and len(generations) != num_slots:
            raise ValueError(f"generations: {len(generations)} words for {num_slots} slots")
        self.num_slots = num_slots
        # free slots: a stack (pop() gives slot 0 first) and a set; a slot assigned without
        # take_free() leaves a stale stack entry, skipped when popped (all O(1))
        self._free: List[int] = list(range(num_slots - 1, -1, -1))
        self._free_set: Set[int] = set(self._free)
        self._lru: OrderedDict[int, int] = OrderedDict()  # key -> slot, oldest first
        self._key_of: Dict[int, int] = {}  # slot -> key
        self._gen: GenerationWords = (generations if generations is not None
                                           else [0] * num_slots)

    def lookup(self, key: int, touch: bool = True) -> Optional[Tuple[int, int]]:
        """``(slot, generation)`` holding ``key``, or None."""
        slot = self._lru.get(key)
        if slot is None:
            return None
        if touch:
            self._lru.move_to_end(key)
        return slot, int(self._gen[slot])

    def holds(self, key: int) -> bool:
        """Whether a slot holds ``key`` (no LRU touch)."""
        return key in self._lru

    def take_free(self) -> Optional[int]:
        got = self.take_free_many(1)
        return got[0] if got else None

    def take_free_many(self, count: int) -> List[int]:
        """Up to ``count`` free slots (fewer when fewer are free), each taken, in the order
        :meth:`take_free` would give them."""
        stack, free = self._free, self._free_set
        if 0 < count <= len(stack):  # the usual case: the top of the stack, all still free
            top = stack[-count:]
            if free.issuperset(top) and len(set(top)) == count:
                del stack[-count:]
                free.difference_update(top)
                return top[::-1]
        out: List[int] = []
        while stack and len(out) < count:
            slot = stack.pop()
            if slot in free:
                free.discard(slot)
                out.append(slot)
        return out

    def victims(self, count: int, exclude: Container[int] = ()) -> List[int]:
        """Up to ``count`` occupied slots, least recently used first (keys in ``exclude``
        are passed over)."""
        out: List[int] = []
        for key, slot in self._lru.items():
            if len(out) >= count:
                break
            if key not in exclude:
                out.append(slot)
        return out

    def release(self, slot: int) -> Optional[int]:
        """Empty ``slot`` (evicted); returns the key it held."""
        key = self._key_of.pop(slot, None)
        if key is not None:
            del self._lru[key]
            self._free.append(slot)
            self._free_set.add(slot)
        return key

    def assign(self, key: int, slot: int) -> int:
        """Put ``key`` into ``slot`` (free or just released); returns the new generation."""
        return self.assign_many([key], [slot])[0]

    def assign_many(self, keys: Sequence[int], slots: Sequence[int]) -> List[int]:
        """Put ``keys[i]`` into ``slots[i]`` (each free or just released) for every i in one
        pass (the generations bumped together, before anything is written into the slots);
        returns the new generations.  Every pair is checked first: a bad one changes
        nothing."""
        if len(keys) != len(slots):
            raise ValueError(f"slots: {len(slots)} slots for {len(keys)} keys")
        if len(set(keys)) != len(keys) or len(set(slots)) != len(slots):
            raise ValueError("keys, slots: each may appear once in one assign_many")
        if not (self._key_of.keys().isdisjoint(slots) and self._lru.keys().isdisjoint(keys)):
            for key, slot in zip(keys, slots):  # (the first bad pair, named)
                if slot in self._key_of:
                    raise ValueError(f"slot: {slot} still holds key {self._key_of[slot]}; "
                                     f"release it")
                if key in self._lru:
                    raise ValueError(f"key: {key} is already stored in slot "
                                     f"{self._lru[key]}")
        self._free_set.difference_update(slots)
        self._key_of.update(zip(slots, keys))
        self._lru.update(zip(keys, slots))
        gen = self._gen
        if isinstance(gen, np.ndarray):
            idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
            gen[idx] += 1
            return [int(g) for g in gen[idx].tolist()]  # (plain ints, whatever the dtype)
        for slot in slots:
            gen[slot] += 1
        return [int(gen[slot]) for slot in slots]

    def key_of(self, slot: int) -> Optional[int]:
        return self._key_of.get(slot)

    @property
    def used(self) -> int:
        return len(self._key_of)

    @property
    def free(self) -> int:
        return len(self._free_set)


def take_free_slots(alloc: SlotAllocator, count: int) -> List[int]:
    """Up to ``count`` free slots of ``alloc`` (fewer when it has fewer), each taken."""
    return alloc.take_free_many(count)


@dataclass
class Placement:
    """What one group of an export found: the engine blocks to copy and the top-tier slots
    (and their new generations) they go to, in order; the rows already stored (any tier,
    or earlier in the same export: only touched) and those no free slot was left for."""

    keys: List[int] = field(default_factory=list)
    blocks: List[int] = field(default_factory=list)
    slots: List[int] = field(default_factory=list)
    generations: List[int] = field(default_factory=list)
    already_stored: int = 0
    skipped_no_slot: int = 0


def rows_by_group(rows: Sequence[Tuple[int, int, int]]) -> Dict[int, List[Tuple[int, int]]]:
    """``(key, engine block)`` of ``(group, key, engine block)`` rows per group, in order."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    for group, key, block in rows:
        out.setdefault(group, []).append((key, block))
    return out


def place_new(tiers: Sequence[SlotAllocator], rows: Sequence[Tuple[int, int]]) -> Placement:
    """Place ``rows`` (key, engine block) of one group into free slots of ``tiers[0]`` (the
    top tier): a key any tier holds is touched (LRU) and left; the others take free slots
    together, their generations bumped in one pass (:meth:`SlotAllocator.assign_many`)."""
    out = Placement()
    held = [alloc._lru for alloc in tiers]
    fresh: Dict[int, int] = dict(rows)  # key -> engine block (the common save: all new, once)
    if len(fresh) < len(rows) or not all(lru.keys().isdisjoint(fresh) for lru in held):
        fresh = _walk_rows(rows, held, out)
    out.slots = take_free_slots(tiers[0], len(fresh))
    out.skipped_no_slot = len(fresh) - len(out.slots)
    if out.slots:
        out.keys = list(fresh)[:len(out.slots)]
        out.blocks = [int(fresh[k]) for k in out.keys]
        out.generations = tiers[0].assign_many(out.keys, out.slots)
    return out


def _walk_rows(rows: Sequence[Tuple[int, int]], held: Sequence[OrderedDict[int, int]],
               out: Placement) -> Dict[int, int]:
    """:func:`place_new` row by row (a few dict operations a row), for rows with a key
    stored already or named twice: the stored ones touched (LRU) and counted in ``out``;
    returns the new keys, each with its first row's engine block."""
    fresh: Dict[int, int] = {}
    for key, block in rows:
        stored = key in fresh
        for lru in held:
            if key in lru:
                lru.move_to_end(key)  # (touched: LRU)
                stored = True
        if stored:
            out.already_stored += 1
        else:
            fresh[key] = int(block)
    return fresh
