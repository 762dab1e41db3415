"""SlotAllocator: LRU bookkeeping of one tier (pure)."""

import random

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.planning.slot_allocator import (
    SlotAllocator,
    place_new,
    take_free_slots,
)


def test_free_slots_in_order_and_a_directly_assigned_slot_is_never_handed_out():
    a = SlotAllocator(4)
    assert a.take_free() == 0
    a.assign(100, 0)
    a.assign(101, 2)  # a free slot assigned without take_free (a granted victim, say)
    assert a.free == 2
    assert [a.take_free(), a.take_free(), a.take_free()] == [1, 3, None]
    assert a.release(2) == 101 and a.free == 1
    assert a.take_free() == 2 and a.take_free() is None


def test_taking_many_free_slots_gives_what_taking_them_one_by_one_gives():
    """``take_free_many`` (an export's slots in one call) against ``take_free`` on a twin,
    stale stack entries (slots assigned directly, released again) included."""
    twins = [SlotAllocator(8), SlotAllocator(8)]
    for a in twins:
        a.assign(50, 3)  # a stale stack entry
        a.assign(51, 5)
        a.release(5)  # back on the stack, twice there
    one_by_one = [twins[0].take_free() for _ in range(8)]
    assert twins[1].take_free_many(3) + twins[1].take_free_many(9) == [
        s for s in one_by_one if s is not None]
    assert twins[1].take_free_many(1) == [] and twins[1].free == twins[0].free == 0


def test_assign_refuses_an_occupied_slot_and_a_stored_key():
    a = SlotAllocator(2)
    a.assign(7, 0)
    with pytest.raises(ValueError, match="slot: 0 still holds key 7"):
        a.assign(8, 0)
    with pytest.raises(ValueError, match="key: 7 is already stored"):
        a.assign(7, 1)


def test_random_operations_match_a_plain_model():
    """Against a model of sets: free slots are exactly those not holding a key, each
    handed out once; victims come in LRU order."""
    rng = random.Random(3)
    n = 16
    a = SlotAllocator(n)
    held = {}  # slot -> key
    order = []  # keys, least recently used first
    next_key = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            slot = a.take_free()
            if slot is None:
                assert len(held) == n
                continue
            assert slot not in held
            a.assign(next_key, slot)
        elif op < 0.55 and len(held) < n:
            slot = rng.choice([s for s in range(n) if s not in held])  # direct assign
            a.assign(next_key, slot)
        elif op < 0.8 and held:
            slot = rng.choice(sorted(held))
            assert a.release(slot) == held.pop(slot)
            order.remove(next((k for k in order if k not in held.values()), None))
            continue
        elif held:
            key = rng.choice(order)
            a.lookup(key)
            order.remove(key)
            order.append(key)
            continue
        else:
            continue
        held[slot] = next_key
        order.append(next_key)
        next_key += 1
        assert a.free == n - len(held) and a.used == len(held)
    assert a.victims(len(held)) == [next(s for s, k in held.items() if k == key)
                                    for key in order]


def test_generations_can_live_in_words_the_caller_gives():
    """The storage's shared file gives each allocator a row of words: assign bumps there."""
    import numpy as np

    words = np.zeros(3, np.int64)
    alloc = SlotAllocator(3, words)
    assert alloc.assign(7, 1) == 1 and words.tolist() == [0, 1, 0]
    alloc.release(1)
    assert alloc.assign(8, 1) == 2 and alloc.lookup(8) == (1, 2) and words[1] == 2
    with pytest.raises(ValueError, match="generations: 2 words for 3 slots"):
        SlotAllocator(3, np.zeros(2, np.int64))


def test_assign_many_bumps_the_generations_of_a_shared_row_together_and_checks_first():
    """The storage writer's bulk path: keys into slots in one pass, the generations (here a
    numpy row, as the shared ``SlotGenerations`` file gives) bumped before the caller writes;
    a bad pair (a slot still holding a key, a key stored, a repeat) changes nothing."""
    gens = np.zeros(8, dtype=np.int64)
    gens[3] = 41  # generations start where the file holds them
    a = SlotAllocator(8, gens)
    slots = take_free_slots(a, 3)
    assert slots == [0, 1, 2]
    assert a.assign_many([10, 11, 12], slots) == [1, 1, 1]
    assert a.assign_many([13], [3]) == [42] and gens.tolist()[:4] == [1, 1, 1, 42]
    assert a.lookup(11, touch=False) == (1, 1) and a.free == 4 and a.used == 4
    for keys, bad_slots, name in (([20], [0], "slot"), ([10], [4], "key"),
                                  ([20, 21], [4, 4], "keys, slots"), ([20], [4, 5], "slots")):
        with pytest.raises(ValueError, match=f"^{name}"):
            a.assign_many(keys, bad_slots)
    with pytest.raises(ValueError, match="^key"):  # the second pair is bad: the first
        a.assign_many([20, 10], [4, 5])  # is not assigned either
    assert a.key_of(4) is None and not a.holds(20)
    assert gens.tolist() == [1, 1, 1, 42, 0, 0, 0, 0] and a.used == 4 and a.free == 4
    assert a.release(1) == 11 and a.assign_many([11], [1]) == [2]  # reuse bumps again


@pytest.mark.parametrize("seed", range(20))
def test_placing_a_save_keeps_each_new_key_once_with_its_first_block_whatever_the_path(seed):
    """``place_new``: the one-pass path (every key new, each once) and the row-by-row one
    (a key stored in either tier, or named twice) give what the rule says: new keys in
    order of first appearance, each with its first row's block, stored keys touched and
    counted, and nothing taken for them."""
    rng = random.Random(seed)
    top, lower = SlotAllocator(64), SlotAllocator(64)
    for key in range(0, 40, 4):  # keys 0, 4, ... stored: half on top, half below
        (top if key % 8 else lower).assign(key, len(top._lru) + len(lower._lru))
    top_keys_before = list(top._lru)
    pool = list(range(40)) if seed % 2 else list(range(100, 140))  # odd seeds: some stored
    rows = [(rng.choice(pool), rng.randrange(1000)) for _ in range(rng.randrange(1, 30))]
    if seed % 4 == 0:
        rows = [(k, b) for k, b in dict(rows).items()]  # distinct and new: the one pass
    expected: dict = {}
    stored = 0
    for key, block in rows:
        if key in expected or top.holds(key) or lower.holds(key):
            stored += 1
        else:
            expected[key] = block
    placed = place_new([top, lower], rows)
    assert (placed.keys, placed.blocks) == (list(expected), list(expected.values()))
    assert placed.already_stored == stored and placed.skipped_no_slot == 0
    assert [top.lookup(k, touch=False)[0] for k in placed.keys] == placed.slots
    named = {key for key, _ in rows}
    untouched = [k for k in top_keys_before if k not in named]
    order = list(top._lru)  # LRU: untouched stored keys, then the touched ones, then the new
    assert order[:len(untouched)] == untouched
    assert set(order[len(untouched):len(top_keys_before)]) == set(top_keys_before) & named
    assert order[len(top_keys_before):] == placed.keys
