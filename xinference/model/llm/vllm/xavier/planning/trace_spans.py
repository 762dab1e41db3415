"""The step trace's file, and spans of Xavier's own work in it (``XAVIER_STEP_TRACE``).

Off unless ``XAVIER_STEP_TRACE`` names a folder.  Then each process appends JSON lines to
``<folder>/trace-<pid>.jsonl`` (line-buffered: a line survives a killed process), on the
monotonic clock (ns; one clock for every process of the host):

- one per connector call vLLM makes (:mod:`..vllm_side.step_trace` wraps the connector);
- one per :func:`span`: a piece of Xavier's own work, on vLLM's step thread (a step's victim
  saves, its load launch) or on Xavier's threads (a room round, a publication, a load's
  completion), with the thread's CPU time beside the wall time.  Wall time well above the
  CPU time on the step thread is waiting (for the GIL, or in a blocking call); the spans of
  the other threads say who was running meanwhile.

A diagnostic for a benchmark run, not for production: a line costs a write system call (a
few µs).  Off, :func:`span` is one environment lookup.  ``scripts/step_trace_report.py``
reads the lines back."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, ContextManager, Dict, Iterator, Optional

ENV_STEP_TRACE = "XAVIER_STEP_TRACE"


class TraceFile:
    """One process's trace file."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.pid = os.getpid()
        self._file = open(os.path.join(folder, f"trace-{self.pid}.jsonl"), "a",
                          buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def line(self, rank: int, role: str, method: str, t0: int, t1: int,
             fields: Dict[str, Any]) -> None:
        text = json.dumps({"rank": rank, "role": role, "m": method, "t0": t0, "t1": t1,
                           **fields},
                          separators=(",", ":"))
        with self._lock:
            self._file.write(text + "\n")


_FILE: Optional[TraceFile] = None


def trace_file() -> Optional[TraceFile]:
    """This process's trace file, or None when the trace is off (raises ``OSError`` when
    the folder cannot be made)."""
    global _FILE
    folder = os.environ.get(ENV_STEP_TRACE)
    if not folder:
        return None
    if _FILE is None or _FILE.pid != os.getpid():  # (a forked child: its own)
        _FILE = TraceFile(folder)
    return _FILE


_OFF: ContextManager[None] = contextlib.nullcontext()


def span(rank: int, name: str, **fields: Any) -> ContextManager[None]:
    """A line for the work inside the ``with`` block: ``name``, its wall and its thread's
    CPU time (``cpu``, ns), the thread's name, ``fields``; nothing when the trace is off.
    Never raises for the trace's sake (a line that cannot be written is dropped)."""
    if not os.environ.get(ENV_STEP_TRACE):
        return _OFF
    return _span(rank, name, fields)


@contextlib.contextmanager
def _span(rank: int, name: str, fields: Dict[str, Any]) -> Iterator[None]:
    t0, c0 = time.monotonic_ns(), time.thread_time_ns()
    try:
        yield
    finally:
        t1, c1 = time.monotonic_ns(), time.thread_time_ns()
        try:
            trace = trace_file()
            if trace is not None:
                trace.line(rank, "SPAN", name, t0, t1,
                           {"cpu": c1 - c0, "thread": threading.current_thread().name,
                            **fields})
        except Exception:  # a full disk, a folder gone: the work itself has run
            pass
