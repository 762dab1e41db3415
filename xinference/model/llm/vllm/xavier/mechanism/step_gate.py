"""Xavier's background threads hold back while vLLM's step thread launches a step's loads.

A vLLM worker process runs Python on one thread at a time (the GIL).  When the step thread
saves a step's victims and launches its loads (``start_load_kv``), the save itself wakes
Xavier's room thread (demotions) and publisher thread (directory registrations), whose
Python work then takes the GIL from the step thread for up to the switch interval each time
it gives it up: on an H100 a hit's load launch took 7.1 ms of wall time for 1.55 ms of CPU
with the saves, 2.4 for 1.1 without them (doc/benchmarks.md, session 36).  At one request
at a time that wait is the hit's own: nothing else is in the engine.

:data:`STEP_GATE` is closed by the step thread around the launch (:meth:`StepGate.closed`)
and those threads wait at it (:meth:`StepGate.wait_open`) before each piece of their work,
so it runs after the launch instead (a piece already running finishes first).  One gate
per process: a worker process has one step thread.  A thread never waits at a closed gate
for more than :data:`GATE_MAX_WAIT_S` (a step thread stuck in a launch holds nothing up
for long).  ``XAVIER_STEP_GATE=0`` leaves the gate always open (a diagnostic: the
benchmark's ``batched-nogate`` row)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from ..planning.log_names import package_logger
from ..planning.options import step_gate_on

logger = package_logger(__name__)

#: the longest a background thread waits at a closed gate
GATE_MAX_WAIT_S = 0.05


class StepGate:
    """Open unless the step thread is inside :meth:`closed` (see the module docstring)."""

    def __init__(self, enabled: bool = True, max_wait_s: float = GATE_MAX_WAIT_S) -> None:
        self.enabled, self.max_wait_s = enabled, max_wait_s
        self._open = threading.Event()
        self._open.set()

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """Closed for the ``with`` block (not reentrant: the step thread's launch only)."""
        if not self.enabled:
            yield
            return
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def wait_open(self) -> bool:
        """Wait until the gate is open (at most ``max_wait_s``); whether it is."""
        return self._open.wait(self.max_wait_s)


def _from_environment() -> StepGate:
    try:
        return StepGate(enabled=step_gate_on(os.environ))
    except ValueError as exc:  # (refused at launch: a process started otherwise)
        logger.warning("xavier: %s; the step gate stays on", exc)
        return StepGate()


STEP_GATE = _from_environment()
