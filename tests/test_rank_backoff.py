"""A failing peer's backoff (:mod:`xinference.model.llm.vllm.xavier.planning.rank_backoff`):
the one rule of the peer mappings and the reads of other hosts."""

import pytest

from xinference.model.llm.vllm.xavier.planning.rank_backoff import RankBackoff


def test_waits_double_in_a_row_up_to_the_cap_and_start_again_long_after():
    clock = [100.0]
    backoff = RankBackoff(5.0, 20.0, lambda: clock[0])
    assert not backoff and not backoff.waiting(3, clock[0])
    assert [backoff.failed(3) for _ in range(4)] == [5.0, 10.0, 20.0, 20.0]
    assert backoff and backoff.waiting(3, clock[0] + 19.9) and not backoff.waiting(3, 120.0)
    assert not backoff.waiting(4, clock[0])  # (per rank)
    clock[0] = 120.0 + 20.0 + 0.1  # more than the cap after the last wait ended
    assert backoff.failed(3) == 5.0
    backoff.failed(3)
    backoff.forget(3)  # it answered: no wait, no doubling
    assert not backoff.waiting(3, clock[0]) and backoff.failed(3) == 5.0


def test_a_base_above_the_cap_is_refused_naming_both():
    with pytest.raises(ValueError, match="base_s, max_s"):
        RankBackoff(10.0, 5.0, lambda: 0.0)
