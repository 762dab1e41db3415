"""How long the connector held one of vLLM's steps: the time its scheduler methods took to
build the step plus the time its worker methods took in it (``start_load_kv``,
``wait_for_save``, ``get_finished``).  Under async scheduling the two halves overlap
vLLM's own work, so their sum is an upper bound of the delay Xavier added to the step.

Counted per step of the replica's first (tensor-parallel rank 0) worker, as the
scheduler's figures are, as a histogram (``steps_held_over_<ms>ms``: steps whose hold
passed each bound) and a level, the longest hold seen (``step_hold_max_us``), so that "a
dark peer never stalls a step" is read from the counters of any window.  Pure: no torch.
"""

from __future__ import annotations

from typing import Protocol, Tuple

#: the histogram's bounds (ms): a step held longer than each is counted under its name
HOLD_BOUNDS_MS: Tuple[int, ...] = (10, 50, 250)
HOLD_COUNTER_NAMES: Tuple[str, ...] = tuple(f"steps_held_over_{ms}ms" for ms in HOLD_BOUNDS_MS)
HOLD_MAX_NAME = "step_hold_max_us"


def held_over(hold_us: int) -> Tuple[str, ...]:
    """The histogram counters a step held ``hold_us`` µs adds one to."""
    return tuple(name for ms, name in zip(HOLD_BOUNDS_MS, HOLD_COUNTER_NAMES)
                 if hold_us > 1000 * ms)


class _Counters(Protocol):
    def add(self, name: str, value: int = 1) -> None: ...

    def get(self, name: str) -> int: ...

    def set(self, name: str, value: int) -> None: ...


def count_step_hold(counters: _Counters, held_us: int) -> None:
    """One step's hold (µs) into ``counters``: the histogram and the longest hold."""
    for name in held_over(held_us):
        counters.add(name)
    if held_us > counters.get(HOLD_MAX_NAME):
        counters.set(HOLD_MAX_NAME, held_us)


class StepHoldClock:
    """The worker's time in one step's connector calls, summed until the step ends."""

    def __init__(self) -> None:
        self._us = 0

    def add(self, us: int) -> None:
        """Add ``us`` µs of the step (a worker call's, or the scheduler's share)."""
        self._us += max(0, int(us))

    def take(self) -> int:
        """The step's hold (µs); the clock starts again from zero."""
        us, self._us = self._us, 0
        return us
