"""The scheduler side's book of blocks published in place (``planning/in_place.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.planning.in_place import InPlaceBook, PeerHolding, Saves
from xinference.model.llm.vllm.xavier.planning.shards import Shards


def _book(blocks: int = 8, tp: int = 1, groups: int = 1):
    rows = [np.zeros(blocks, np.int64) for _ in range(tp)]
    return InPlaceBook(rows, Shards(groups, tp)), rows


def test_publication_names_each_block_at_its_generation_now():
    book, rows = _book()
    book.handed_out([2, 3])  # vLLM hands them out to be written: bumped first
    assert rows[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert book.publish([(0, 111, 2), (0, 112, 3)]) == ((0, 111, 2, 1), (0, 112, 3, 1))
    assert book.published == 2


def test_every_tp_workers_file_is_bumped_alike():
    book, rows = _book(tp=2)
    book.handed_out([5, 1])
    assert rows[0].tolist() == rows[1].tolist() == [0, 1, 0, 0, 0, 1, 0, 0]
    assert book.bumped == 2


def test_a_published_block_handed_out_again_is_a_victim_and_forgotten_in_every_shard():
    book, rows = _book(tp=2, groups=2)
    book.handed_out([4, 6])
    book.publish([(1, 777, 4), (0, 778, 6)])
    book.handed_out([4, 7])  # 4 was published; 7 never was
    assert book.take_victims() == ((1, 777, 4),) and book.reused == 1
    # directory group = group * tp + shard: both shards of group 1, at 4's generation now
    assert book.take_forgotten() == {2: [(4, 2)], 3: [(4, 2)]}
    assert book.take_victims() == () and book.take_forgotten() == {}
    assert book.published == 1  # 6 stays published
    book.handed_out([4])  # no longer published: neither a victim nor forgotten again
    assert book.take_victims() == () and book.take_forgotten() == {}


def test_a_victim_vllm_zeroes_before_the_worker_sees_the_step_is_not_saved():
    """vLLM 0.27 zeroes some new blocks (``new_block_ids_to_zero``) before the connector's
    first worker hook: their published bytes are gone, so they must not be saved under
    their names (they are still forgotten)."""
    book, _ = _book()
    book.handed_out([1, 2])
    book.publish([(0, 10, 1), (0, 20, 2)])
    book.handed_out([1, 2])
    assert book.take_victims(zeroed={2}) == ((0, 10, 1),)
    assert sorted(book.take_forgotten()[0]) == [(1, 2), (2, 2)]


def _peers(now_names, ever_names=(), asked=None):
    """A stand-in for the same-host peers' host indexes (``HostHolders.holding``)."""

    def holding(rows):
        if asked is not None:
            asked.append(list(rows))
        return PeerHolding(np.array([n in now_names for _, n, _ in rows], bool),
                           np.array([n in now_names or n in ever_names for _, n, _ in rows],
                                    bool))
    return holding


def test_saves_leave_out_what_a_peer_holds_and_saves_off_keeps_no_victim():
    book, _ = _book()
    book.handed_out([1, 2, 3])
    book.publish([(0, 10, 1), (0, 20, 2), (0, 30, 3)])
    book.handed_out([1, 2, 3])
    asked = []
    held = _peers({20}, asked=asked)
    assert book.take_saves((), "all", held) == Saves(((0, 10, 1), (0, 30, 3)), 1, 0)
    assert asked == [[(0, 10, 1), (0, 20, 2), (0, 30, 3)]]
    # saves off (``xavier_save_victims``): nothing saved, and the book keeps no victim
    # (they are taken every step: none piles up for the engine's lifetime)
    for _ in range(3):
        book.publish([(0, 40, 4)])
        book.handed_out([4])
        assert book.take_saves((), "off", held) == Saves(())
        assert book.take_victims() == ()
    assert len(asked) == 1  # (no peer asked about blocks never saved)
    book.publish([(0, 50, 5)])
    book.handed_out([5])
    assert book.take_saves((), "all") == Saves(((0, 50, 5),), 0, 0)  # no same-host peer known


def test_shared_saves_only_what_was_loaded_here_or_held_by_a_peer_once():
    """``shared`` (the default): of the victims no peer holds now, those this replica loaded
    (until the block is handed out again) and those a peer held once are saved; a block
    only ever computed here, and never in a peer's index, is not (counted)."""
    book, _ = _book()
    book.handed_out([1, 2, 3, 4, 5])  # 1 and 2: destinations of this step's loads
    book.loaded([1, 2])
    book.publish([(0, 10, 1), (0, 20, 2), (0, 30, 3), (0, 40, 4), (0, 50, 5)])
    book.handed_out([1, 2, 3, 4, 5])
    # 20 is held by a peer now (not saved, whatever the policy); 40 was held by one once
    got = book.take_saves((), "shared", _peers({20}, {40}))
    assert got == Saves(((0, 10, 1), (0, 40, 4)), held_elsewhere=1, never_shared=2)
    # handed out, a block forgets its load: computed here next time, never shared
    book.publish([(0, 11, 1), (0, 31, 3)])
    book.handed_out([1, 3])
    assert book.take_saves((), "shared", _peers(set())) == Saves((), 0, 2)
    # no same-host peer known: what was loaded here is still saved; a zeroed one is not
    book.handed_out([6, 7])
    book.loaded([6, 7])
    book.publish([(0, 60, 6), (0, 70, 7)])
    book.handed_out([6, 7])
    assert book.take_saves({7}, "shared") == Saves(((0, 60, 6),), 0, 0)
    # a victim taken without saving (saves off) leaves no loaded mark behind
    book.loaded([3])
    book.publish([(0, 32, 3)])
    book.handed_out([3])
    assert book.take_saves((), "off") == Saves(())
    book.publish([(0, 33, 3)])
    book.handed_out([3])
    assert book.take_saves((), "shared") == Saves((), 0, 1)


def test_a_published_block_handed_out_as_a_load_destination_is_saved_by_its_new_bytes():
    """In one step vLLM hands a published block out as a load's destination: as a victim
    it was never loaded (not saved); its new bytes are (saved when handed out next)."""
    book, _ = _book()
    book.handed_out([3])
    book.publish([(0, 30, 3)])
    book.handed_out([3])  # scheduling the step: the pool hands 3 out ...
    book.loaded([3])  # ... and the step's metadata names it a load's destination
    assert book.take_saves((), "shared") == Saves((), 0, 1)
    book.publish([(0, 31, 3)])
    book.handed_out([3])
    assert book.take_saves((), "shared") == Saves(((0, 31, 3),), 0, 0)


def test_an_unknown_save_policy_is_refused_naming_the_option():
    book, _ = _book()
    with pytest.raises(ValueError, match="^xavier_save_victims: expected one of shared, all, "
                                         "off, got False"):
        book.take_saves((), False)  # type: ignore[arg-type]


def test_a_reset_bumps_every_block_and_forgets_without_saving():
    book, rows = _book()
    book.handed_out([1])
    book.publish([(0, 5, 1), (0, 6, 2)])
    book.reset()
    assert rows[0].tolist() == [1, 2, 1, 1, 1, 1, 1, 1]
    assert book.take_victims() == () and sorted(book.take_forgotten()[0]) == [(1, 2), (2, 1)]
    assert book.published == 0


def test_no_rows_is_an_error_naming_them():
    with pytest.raises(ValueError, match="^rows:"):
        InPlaceBook([], Shards(1))
