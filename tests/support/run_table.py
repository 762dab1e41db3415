"""What a test run cost, per test file: seconds, vLLM engine starts, Xinference servers and
workers started.  Printed at the end of every run (``tests/conftest.py``), beside the
reliability summary; written as JSON to ``$XAVIER_TEST_RUN_TABLE_JSON`` when that is set.

Engine starts are counted from the processes themselves, wherever they run (under this
process, under ``xinference-local``, inside a simulated host's network namespace: one PID
namespace): a watcher thread lists this process's descendants (another test run on the
same machine is not counted) every ``POLL_S`` seconds and
counts each new vLLM engine-core process (vLLM titles it ``VLLM::EngineCore``) and each
new ``xinference-local`` / ``xinference-supervisor`` / ``xinference-worker`` process for the
test file running at that moment.  An engine core lives at least its start-up (10 s and
more here), so the poll cannot miss one.  Engines started inside this process (vLLM's
in-process mode, no engine-core process) are counted by :func:`count_in_process_engine`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import psutil

POLL_S = 1.0


@dataclass
class FileCost:
    tests: int = 0
    seconds: float = 0.0
    engine_starts: int = 0
    xinference_servers: int = 0
    xinference_workers: int = 0
    shared_worlds: List[str] = field(default_factory=list)


_COSTS: Dict[str, FileCost] = {}
_LOCK = threading.Lock()
_current: List[str] = ["(collection)"]


def _cost(path: str) -> FileCost:
    return _COSTS.setdefault(path, FileCost())


def kind_of(cmdline: List[str]) -> Optional[str]:
    """``"engine"``, ``"server"``, ``"worker"`` or None for a process's command line."""
    text = " ".join(cmdline)
    if "VLLM::EngineCore" in text:  # vLLM's process title (not a script that names it)
        return "engine"
    if "xinference-local" in text or "xinference-supervisor" in text:
        return "server"
    if "xinference-worker" in text:
        return "worker"
    return None


class ProcessWatcher:
    """Counts new engine-core and Xinference processes machine-wide (see the module)."""

    def __init__(self) -> None:
        self._seen: Set[Tuple[int, float]] = set()
        self._stop = threading.Event()
        self._scanning = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="run-table-watcher",
                                        daemon=True)
        self._scan(count=False)  # what runs before the tests is not theirs

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._scan(count=True)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._scan(count=True)

    def scan_now(self) -> None:
        """Count what runs now (the fast loop's check after each test)."""
        self._scan(count=True)

    def _scan(self, count: bool) -> None:
        with self._scanning:
            self._scan_locked(count)

    def _scan_locked(self, count: bool) -> None:
        try:  # this run's processes only (another run on the machine is not ours)
            ours = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        for p in ours:
            try:
                key = (p.pid, p.create_time())
                if key in self._seen:
                    continue
                kind = kind_of(p.cmdline())
            except (psutil.Error, TypeError):
                continue
            if kind is None:
                continue
            self._seen.add(key)
            if count:
                with _LOCK:
                    cost = _cost(_current[0])
                    if kind == "engine":
                        cost.engine_starts += 1
                    elif kind == "server":
                        cost.xinference_servers += 1
                    else:
                        cost.xinference_workers += 1


def count_in_process_engine() -> None:
    """An engine started in this process (vLLM's in-process mode: no engine-core process)."""
    with _LOCK:
        _cost(_current[0]).engine_starts += 1


def note_shared_world(name: str) -> None:
    """A shared world (``tests/support/worlds.py``) was started while this file ran."""
    with _LOCK:
        _cost(_current[0]).shared_worlds.append(name)


def engine_starts() -> Dict[str, int]:
    """Test file -> engines and Xinference servers it started (files that started none are
    left out)."""
    with _LOCK:
        return {p: c.engine_starts + c.xinference_servers for p, c in _COSTS.items()
                if c.engine_starts + c.xinference_servers}


def total_starts() -> int:
    """Engines and Xinference servers and workers counted so far, every file."""
    with _LOCK:
        return sum(c.engine_starts + c.xinference_servers + c.xinference_workers
                   for c in _COSTS.values())


def enter_file(path: str) -> None:
    with _LOCK:
        _current[0] = path
        _cost(path)


def add_time(path: str, seconds: float, test_done: bool) -> None:
    """One phase (setup, call, teardown) of a test of ``path``; ``test_done``: its last."""
    with _LOCK:
        cost = _cost(path)
        cost.tests += int(test_done)
        cost.seconds += seconds


def table() -> List[str]:
    rows = [(path, c) for path, c in _COSTS.items()
            if c.tests or c.engine_starts or c.xinference_servers or c.xinference_workers]
    if not rows:
        return []
    w = max(len(p) for p, _ in rows + [("total", FileCost())])
    lines = [f"{'test file':<{w}}  tests  seconds  engines  servers  workers  shared worlds "
             "started"]
    for path, c in sorted(rows, key=lambda r: -r[1].seconds):
        lines.append(f"{path:<{w}}  {c.tests:>5}  {c.seconds:>7.0f}  {c.engine_starts:>7}  "
                     f"{c.xinference_servers:>7}  {c.xinference_workers:>7}  "
                     f"{', '.join(c.shared_worlds)}")
    t = [c for _, c in rows]
    lines.append(f"{'total':<{w}}  {sum(c.tests for c in t):>5}  "
                 f"{sum(c.seconds for c in t):>7.0f}  {sum(c.engine_starts for c in t):>7}  "
                 f"{sum(c.xinference_servers for c in t):>7}  "
                 f"{sum(c.xinference_workers for c in t):>7}")
    return lines


def process_counts() -> Dict[str, Dict[str, Any]]:
    """What this process's watcher counted, per file (a pytest-xdist worker hands it to the
    controller, which has the tests' times from their reports)."""
    with _LOCK:
        return {p: {"engine_starts": c.engine_starts,
                    "xinference_servers": c.xinference_servers,
                    "xinference_workers": c.xinference_workers,
                    "shared_worlds": list(c.shared_worlds)} for p, c in _COSTS.items()}


def add_process_counts(counts: Dict[str, Dict[str, Any]]) -> None:
    """Add a worker's :func:`process_counts`."""
    with _LOCK:
        for path, got in counts.items():
            cost = _cost(path)
            cost.engine_starts += int(got["engine_starts"])
            cost.xinference_servers += int(got["xinference_servers"])
            cost.xinference_workers += int(got["xinference_workers"])
            cost.shared_worlds.extend(got["shared_worlds"])


def write_json(wall_s: float) -> None:
    out = os.environ.get("XAVIER_TEST_RUN_TABLE_JSON")
    if out and _COSTS:
        with open(out, "w") as f:
            json.dump({"wall_s": round(wall_s, 1),
                       "files": {p: asdict(c) for p, c in _COSTS.items()}}, f, indent=1)


_T0 = time.monotonic()


def wall_seconds() -> float:
    return time.monotonic() - _T0
