"""The slot generations file: one owner writes, every reader of the host sees the words;
each storage has its own incarnation; a file of another incarnation is refused by name."""

import os

import pytest

from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations


def test_a_reader_sees_the_owner_s_bumps_and_the_file_goes_with_the_owner():
    owner = SlotGenerations.create({(0, 0): 4, (1, 0): 2, (1, 1): 3})
    reader = SlotGenerations.open(owner.handle())
    assert reader.incarnation == owner.incarnation > 0
    owner.row(1, 1)[2] += 1
    owner.row(0, 0)[0] += 5
    assert reader.row(1, 1).tolist() == [0, 0, 1]
    assert reader.row(0, 0).tolist() == [5, 0, 0, 0] and reader.row(1, 0).tolist() == [0, 0]
    path = owner.path
    reader.close()
    reader.close()
    assert os.path.exists(path)  # a reader's close leaves the owner's file
    owner.close()
    owner.close()
    assert not os.path.exists(path)


def test_every_storage_has_its_own_incarnation_and_a_stale_handle_is_refused():
    first = SlotGenerations.create({(0, 0): 2})
    second = SlotGenerations.create({(0, 0): 2})
    try:
        assert first.incarnation != second.incarnation
        path, _, layout = first.handle()
        with pytest.raises(ValueError, match=r"generations: .* holds format/incarnation"):
            SlotGenerations.open((path, second.incarnation, layout))
    finally:
        first.close()
        second.close()
    with pytest.raises(ValueError, match=r"slots: every \(tier, group\) needs at least one"):
        SlotGenerations.create({(0, 0): 0})
