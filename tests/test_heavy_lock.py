"""The heavy lock of the test run (tests/support/heavy_lock.py) across real processes: a
second holder waits while the first holds it, gets it once the first lets go, and at once
when the first holder's process dies without letting go."""

import os
import subprocess
import sys
import time

from .support.heavy_lock import HeavyLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.support.heavy_lock import HeavyLock
lock = HeavyLock("holder", sys.argv[2])
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
if sys.argv[4] == "release":
    lock.release()
time.sleep(60)
"""


def holder(path: str, hold_s: float, then: str) -> subprocess.Popen:
    """Another process holding the lock at ``path`` for ``hold_s``, then letting go
    (``release``) or keeping it (``keep``) until killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, ROOT, path, str(hold_s), then],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_second_holder_waits_until_the_first_lets_go(tmp_path):
    path = str(tmp_path / "heavy.lock")
    p = holder(path, 1.0, "release")
    try:
        lock = HeavyLock("second", path)
        assert 0.5 < lock.acquire() < 30  # (the holder let go after 1 s)
        lock.release()
        lock.release()  # idempotent
    finally:
        p.kill()
        p.wait()


def test_a_holder_that_dies_lets_the_next_in(tmp_path):
    path = str(tmp_path / "heavy.lock")
    p = holder(path, 60.0, "keep")
    time.sleep(0.3)
    p.kill()
    p.wait()
    with HeavyLock("next", path) as lock:
        assert lock.waited_s < 5
