"""How long the connector held a step (planning/step_hold.py): the histogram's bounds, the
longest hold, and the clock that sums a step's calls."""

from xinference.model.llm.vllm.xavier.planning.counters import GAUGE_NAMES, Counters
from xinference.model.llm.vllm.xavier.planning.step_hold import (
    HOLD_COUNTER_NAMES,
    HOLD_MAX_NAME,
    StepHoldClock,
    count_step_hold,
    held_over,
)


def test_a_hold_counts_under_every_bound_it_passed():
    assert held_over(0) == () == held_over(10_000)  # 10 ms is not over 10 ms
    assert held_over(10_001) == ("steps_held_over_10ms",)
    assert held_over(50_001) == ("steps_held_over_10ms", "steps_held_over_50ms")
    assert held_over(10**7) == HOLD_COUNTER_NAMES


def test_counters_keep_the_histogram_and_the_longest_hold():
    counters = Counters()
    for held in (3_000, 60_000, 12_000, 300_000, 40_000):
        count_step_hold(counters, held)
    snap = counters.snapshot()
    assert snap["steps_held_over_10ms"] == 4
    assert snap["steps_held_over_50ms"] == 2
    assert snap["steps_held_over_250ms"] == 1
    assert snap[HOLD_MAX_NAME] == 300_000 and HOLD_MAX_NAME in GAUGE_NAMES
    count_step_hold(counters, 1_000)  # a shorter hold leaves the longest as it was
    assert counters.snapshot()[HOLD_MAX_NAME] == 300_000


def test_the_clock_sums_one_step_and_starts_again():
    clock = StepHoldClock()
    clock.add(700)
    clock.add(-5)  # (a clock step backwards is no time)
    clock.add(300)
    assert clock.take() == 1_000
    assert clock.take() == 0
