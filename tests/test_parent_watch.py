"""watch_parent: a child whose parent is SIGKILLed terminates itself (real processes)."""

import os
import signal
import subprocess
import sys
import time

import psutil

CHILD = """
import time
from xinference.model.llm.vllm.xavier.vllm_side.parent_watch import watch_parent
assert watch_parent(interval_s=0.1, grace_s=1.0)
assert not watch_parent()  # once per process
print("watching", flush=True)
time.sleep(120)
"""

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
while child.stdout.readline().strip() != b"watching":  # (imports may log first)
    assert child.poll() is None
print(child.pid, flush=True)
time.sleep(120)
"""


def _orphan(watch: bool) -> int:
    child_code = CHILD if watch else "print('watching', flush=True)\nimport time\ntime.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, child_code], stdout=subprocess.PIPE,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    child_pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    return child_pid


def test_child_exits_when_its_parent_is_killed():
    pid = _orphan(watch=True)
    gone, alive = psutil.wait_procs([psutil.Process(pid)], timeout=15)
    assert not alive


def test_negative_control_without_the_watch_the_child_lives_on():
    pid = _orphan(watch=False)
    time.sleep(2)
    proc = psutil.Process(pid)
    assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    proc.kill()
