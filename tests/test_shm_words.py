"""Shared-memory files and their owners (``planning/shm_words.py``): the sweep of orphaned
files decides by the owner's lock, so a live owner that the sweeping process cannot see
(another PID namespace: containers sharing ``/dev/shm``) keeps its files, and a dead one's
go.  Real processes; the PID namespace is a real one (``unshare --pid``, root)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import remove_orphaned_shm_files
from xinference.model.llm.vllm.xavier.planning.shm_words import ShmWords

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OWNER = r"""
import sys, time
from _xinference_xavier_fork.planning.shm_words import ShmWords
words = ShmWords.create(4, sys.argv[1])
words.words[:] = 7
print(words.path, flush=True)
time.sleep(600)
"""

SWEEP = r"""
import json, sys
from _xinference_xavier_fork.mechanism.snapshot_storage import remove_orphaned_shm_files
print("SWEPT " + json.dumps(remove_orphaned_shm_files(sys.argv[1])), flush=True)
"""


def env():
    return dict(os.environ, PYTHONPATH=REPO)


def start_owner(directory) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(directory)], env=env(),
                            stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert path, "the owner process did not create its file"
    return proc, path


def sweep_in_new_pid_namespace(directory) -> list:
    """The sweep run by a process that sees none of this host's processes (a container)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) not installed")
    out = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", SWEEP,
                          str(directory)], env=env(), capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip("no permission for a new PID namespace (needs root)")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SWEPT ")]
    assert out.returncode == 0 and lines, out.stderr[-2000:]
    import json

    return json.loads(lines[-1][len("SWEPT "):])


def test_a_live_owner_in_another_pid_namespace_keeps_its_file_and_a_dead_one_s_go(tmp_path):
    """A sweep in a new PID namespace cannot see the owner's pid: it keeps the file all the
    same (the owner holds its lock).  Negative control: a file of the same live pid without
    an owner lock (as every file was named before) is removed by that sweep -- the old rule
    unlinked live files of other containers.  Once the owner is killed, a sweep here
    removes its file and its lock."""
    owner, path = start_owner(tmp_path)
    try:
        legacy = tmp_path / f"xavier-{owner.pid}-{'c' * 32}"
        legacy.write_bytes(b"x")
        swept = sweep_in_new_pid_namespace(tmp_path)
        assert swept == [str(legacy)]  # the pid-only file went, though its process lives
        assert os.path.exists(path)
        assert ShmWords.open(path, 4).words.tolist() == [7] * 4  # and it is still the owner's
        assert remove_orphaned_shm_files(str(tmp_path)) == []  # nor here
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
    assert remove_orphaned_shm_files(str(tmp_path)) == [path]
    assert os.listdir(tmp_path) == []  # its owner lock went too


def test_this_process_s_files_share_one_owner_lock_held_while_it_lives(tmp_path):
    a, b = ShmWords.create(2, str(tmp_path)), ShmWords.create(2, str(tmp_path))
    try:
        owners = sorted(n for n in os.listdir(tmp_path) if n.endswith(".owner"))
        assert len(owners) == 1 and owners[0].startswith(f"xavier-{os.getpid()}-")
        token = owners[0][len(f"xavier-{os.getpid()}-"):-len(".owner")]
        assert all(os.path.basename(w.path).startswith(f"xavier-{os.getpid()}-{token}")
                   for w in (a, b))
        assert remove_orphaned_shm_files(str(tmp_path)) == []
    finally:
        a.close()
        b.close()
    assert os.listdir(tmp_path) == owners  # the lock stays while this process lives
