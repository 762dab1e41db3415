"""The step gate (mechanism/step_gate.py): Xavier's room and publisher threads hold back
while vLLM's step thread launches a step's saves and loads, and go on after it."""

import threading
import time

import pytest

from xinference.model.llm.vllm.xavier.mechanism import step_gate
from xinference.model.llm.vllm.xavier.planning.options import step_gate_on

from .test_storage_writer import World


def test_a_closed_gate_holds_a_waiting_thread_until_it_opens_and_never_longer_than_its_bound():
    gate = step_gate.StepGate(max_wait_s=5.0)
    passed = threading.Event()

    def background():
        gate.wait_open()
        passed.set()

    with gate.closed():
        t = threading.Thread(target=background)
        t.start()
        assert not passed.wait(0.2)
    assert passed.wait(5)
    t.join()
    bounded = step_gate.StepGate(max_wait_s=0.05)
    with bounded.closed():
        t0 = time.monotonic()
        assert not bounded.wait_open()  # (a stuck launch holds nobody for long)
        assert time.monotonic() - t0 < 1.0
    off = step_gate.StepGate(enabled=False, max_wait_s=5.0)
    with off.closed():
        assert off.wait_open()


def test_the_setting_is_read_and_a_bad_value_named():
    assert step_gate_on({}) and step_gate_on({"XAVIER_STEP_GATE": "1"})
    assert not step_gate_on({"XAVIER_STEP_GATE": " 0 "})
    with pytest.raises(ValueError, match="^XAVIER_STEP_GATE: expected 0 or 1, got 'no'"):
        step_gate_on({"XAVIER_STEP_GATE": "no"})


@pytest.mark.parametrize("enabled", [True, False])
def test_a_saves_publication_waits_for_the_launch_to_end(monkeypatch, enabled):
    """A victim save's publication (the publisher thread's directory call) is not made while
    the step thread is inside its launch; negative control: with the gate off, it is."""
    monkeypatch.setattr(step_gate.STEP_GATE, "enabled", enabled)
    monkeypatch.setattr(step_gate.STEP_GATE, "max_wait_s", 10.0)
    w = World(7, gpu_blocks=8)
    rows = [(0, 1000 + i, i) for i in range(4)]

    def registered() -> int:
        return w.counters.get("export_published")

    try:
        with step_gate.STEP_GATE.closed():
            w.writer.export(w.views, rows, after_forward=False)
            deadline = time.monotonic() + (0.3 if enabled else 10)
            while time.monotonic() < deadline and not registered():
                time.sleep(0.01)
            assert registered() == (0 if enabled else 4)
        assert w.writer.flush(10) and registered() == 4
    finally:
        w.writer.close()
