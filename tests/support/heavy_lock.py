"""One memory-heavy set of engines at a time across the run's processes.

The engine tests run in two pytest-xdist groups side by side (:mod:`.run_order`); on the
23 GiB CI machine one tensor-parallel world (four vLLM workers, each ~1.5 GiB of its own
and its KV cache in ``/dev/shm``) beside another test's tensor-parallel launch is more
than it holds (session 41's CI54: the OOM killer took a TP worker).  Each of those holds
:class:`HeavyLock` while its engines live: an exclusive ``flock`` on one file of the
machine, so the other waits (the kernel drops the lock of a process that died).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from typing import IO, Optional

#: the lock's file, one for the machine (two test runs side by side share it too)
LOCK_PATH = os.path.join(tempfile.gettempdir(), "xavier-tests-heavy-engines.lock")


class HeavyLock:
    """Held by one heavy user of engine memory at a time (module docstring); ``what``
    names the holder in the file, for the waiter's log line."""

    def __init__(self, what: str, path: str = LOCK_PATH) -> None:
        self.what, self.path = what, path
        self._file: Optional[IO[str]] = None
        #: seconds the last :meth:`acquire` waited for another holder
        self.waited_s = 0.0

    def acquire(self) -> float:
        """Wait for the lock (no timeout: the holder's engines end with its test or world,
        or with its process); returns the seconds waited."""
        if self._file is not None:
            raise RuntimeError(f"heavy lock: {self.what} holds it already")
        f = open(self.path, "a+")
        t0 = time.monotonic()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another test"
            print(f"[heavy lock] {self.what} (pid {os.getpid()}) waits for {holder}",
                  flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        self.waited_s = time.monotonic() - t0
        f.seek(0)
        f.truncate()
        f.write(f"{self.what} (pid {os.getpid()})")
        f.flush()
        self._file = f
        return self.waited_s

    def release(self) -> None:
        """Let the next holder in (idempotent)."""
        f, self._file = self._file, None
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()

    def __enter__(self) -> HeavyLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
