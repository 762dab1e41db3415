"""The quiet gate on its own (real threads and clocks): background work waits while the
worker keeps launching, goes once it is quiet, at the latest ``max_defer_s`` after it was
first held back, and at once when urgent, hurried, closed or switched off; a waiter with
other work is let out by a poke and waits again under the same deadline."""

import threading
import time

import pytest

from xinference.model.llm.vllm.xavier.mechanism.quiet_gate import QuietGate
from xinference.model.llm.vllm.xavier.planning.counters import Counters


def keep_busy(gate: QuietGate, seconds: float, every: float = 0.01) -> threading.Thread:
    """A worker launching a load every ``every`` s for ``seconds`` (its own thread)."""
    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            gate.busy()
            time.sleep(every)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def timed(wait) -> tuple:
    t0 = time.monotonic()
    go = wait()
    return go, time.monotonic() - t0


def test_work_waits_until_the_worker_was_quiet_for_quiet_s():
    counters = Counters()
    gate = QuietGate(0.4, 10.0, sink=counters)
    busy = keep_busy(gate, 0.8)
    go, waited = timed(gate.wait)
    busy.join()
    # released ~quiet_s after the last launch (the busy thread's end), not before it
    assert go and 0.8 <= waited < 5.0
    assert counters.get("background_deferrals") == 1
    assert counters.get("background_deferred_us") >= 800_000


def test_a_worker_that_never_goes_quiet_holds_work_back_no_longer_than_max_defer():
    gate = QuietGate(0.5, 0.8, sink=Counters())
    busy = keep_busy(gate, 4.0)
    go, waited = timed(gate.wait)
    assert go and 0.75 <= waited < 3.0
    gate.close()
    busy.join()


def test_quiet_already_means_no_wait():
    counters = Counters()
    gate = QuietGate(0.05, 1.0, sink=counters)
    gate.busy()
    time.sleep(0.1)
    go, waited = timed(gate.wait)
    assert go and waited < 0.2
    assert counters.get("background_deferrals") == 0


@pytest.mark.parametrize("release", ["urgent", "hurried", "close"])
def test_urgent_hurried_or_closed_work_goes_at_once(release):
    gate = QuietGate(2.0, 10.0, sink=Counters())
    busy = keep_busy(gate, 2.5)
    got = []
    if release == "urgent":
        got.append(timed(lambda: gate.wait(urgent=lambda: True)))
    else:
        waiter = threading.Thread(target=lambda: got.append(timed(gate.wait)), daemon=True)
        waiter.start()
        time.sleep(0.1)
        assert not got  # (held back until released)
        if release == "hurried":
            with gate.hurried():
                waiter.join(2.0)
        else:
            gate.close()
            waiter.join(2.0)
            assert timed(gate.wait)[1] < 0.2  # closed for good
    assert got and got[0][0] and got[0][1] < 1.5
    busy.join()


def test_a_poked_waiter_with_other_work_comes_out_then_keeps_its_deadline():
    """The publisher's case: a run for the directory waits; a host-index write queued
    behind it pokes the gate and is done first; the run still goes max_defer_s after it
    was first held back, not after the last poke."""
    gate = QuietGate(1.0, 1.6, sink=Counters())
    busy = keep_busy(gate, 5.0)
    other = threading.Event()
    threading.Timer(0.2, lambda: (other.set(), gate.poke())).start()
    since = time.monotonic()
    go, waited = timed(lambda: gate.wait(interrupt=other.is_set, since=since))
    assert not go and 0.15 < waited < 0.9  # out for the other work, before 1 s of quiet
    other.clear()
    go, _ = timed(lambda: gate.wait(interrupt=other.is_set, since=since))
    assert go and 1.5 < time.monotonic() - since < 4.0  # since + max_defer_s
    gate.close()
    busy.join()


def test_quiet_0_turns_it_off():
    gate = QuietGate(0.0, 0.0, sink=Counters())
    gate.busy()
    go, waited = timed(gate.wait)
    assert go and waited < 0.2


def test_set_at_runtime_releases_a_held_waiter_and_applies_the_new_spell():
    """``XavierEngine.set_quiet_ms``'s mechanism: a waiter held by a long quiet spell goes
    as soon as the spell is set to 0 (not after the old one); a new spell holds the next
    wait again, its deadline MAX_DEFER_QUIETS spells by default."""
    gate = QuietGate(5.0, sink=Counters())
    assert gate.max_defer_s == 20.0  # (MAX_DEFER_QUIETS spells)
    busy = keep_busy(gate, 4.0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(timed(gate.wait)), daemon=True)
    waiter.start()
    time.sleep(0.2)
    assert not got  # held back by the 5 s spell
    gate.set(0.0)
    waiter.join(2.0)
    assert got and got[0][0] and got[0][1] < 1.0
    gate.set(0.3)
    assert (gate.quiet_s, gate.max_defer_s) == (0.3, 1.2)
    go, waited = timed(gate.wait)  # still busy: held until its 1.2 s deadline
    assert go and 0.9 < waited < 3.0
    busy.join()


def test_negative_durations_are_refused_by_name():
    with pytest.raises(ValueError, match="quiet_s"):
        QuietGate(-1, 1, sink=Counters())
    with pytest.raises(ValueError, match="quiet_s"):
        QuietGate(0.1, sink=Counters()).set(-0.5)
