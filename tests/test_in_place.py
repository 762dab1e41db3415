"""The scheduler side's book of blocks published in place (``planning/in_place.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.planning.in_place import InPlaceBook
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


def test_saves_leave_out_what_a_peer_holds_and_saves_off_keeps_no_victim():
    book, _ = _book()
    book.handed_out([1, 2, 3])
    book.publish([(0, 10, 1), (0, 20, 2), (0, 30, 3)])
    book.handed_out([1, 2, 3])
    asked = []

    def held(rows):
        asked.append(list(rows))
        return np.array([name == 20 for _, name, _ in rows])

    assert book.take_saves((), True, held) == (((0, 10, 1), (0, 30, 3)), 1)
    assert asked == [[(0, 10, 1), (0, 20, 2), (0, 30, 3)]]
    # saves off (``xavier_save_victims``): nothing saved, and the book keeps no victim
    # (they are taken every step: none piles up for the engine's lifetime)
    for _ in range(3):
        book.publish([(0, 40, 4)])
        book.handed_out([4])
        assert book.take_saves((), False, held) == ((), 0)
        assert book.take_victims() == ()
    assert len(asked) == 1  # (no peer asked about blocks never saved)
    book.publish([(0, 50, 5)])
    book.handed_out([5])
    assert book.take_saves((), True) == (((0, 50, 5),), 0)  # no same-host peer known


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
