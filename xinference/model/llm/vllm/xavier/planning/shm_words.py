"""Xavier's shared-memory files: their names, their owners, and a file of ``int64`` words.

Every file a process creates in :func:`shm_dir` is named by :func:`owned_name`:
``xavier-<pid>-<token><random>``, where ``token`` (16 hex digits) names the process's
*owner lock*, ``xavier-<pid>-<token>.owner``, a file the process holds a shared ``flock``
on for its whole life (taken before the lock file appears under its name).  The sweep of
orphaned files (``snapshot_storage.remove_orphaned_shm_files``) decides by that lock, not
by the pid: a file whose owner lock it can take exclusively belongs to a dead process.  A
pid says nothing across PID namespaces -- containers sharing ``/dev/shm`` (``docker
--ipc=host``, vLLM's recommended flag) see each other's files but not each other's
processes -- and nothing once the pid was reused.  (Files of older versions have no owner
lock; the sweep falls back to the pid for them.)

:class:`ShmWords` is what :class:`~.counters.SharedCounters` (the worker's counters) and
:class:`~..mechanism.slot_generations.SlotGenerations` (a storage's slot identities) are
made of.  Aligned 8-byte words, so a reader never sees a torn value.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import tempfile
import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

#: a data file: ``xavier-<pid>-<token><random>`` (32 hex digits after the pid)
DATA_NAME = re.compile(r"^xavier-(\d+)-([0-9a-f]{16})[0-9a-f]{16}$")
#: an owner lock: ``xavier-<pid>-<token>.owner``
OWNER_NAME = re.compile(r"^xavier-(\d+)-([0-9a-f]{16})\.owner$")

_owner_lock = threading.Lock()
#: (pid, directory) -> (token, open descriptor holding the shared flock)
_owners: Dict[Tuple[int, str], Tuple[str, int]] = {}


def _after_fork_in_child() -> None:
    """A forked child makes its own owner lock (its pid differs); the lock guarding the
    table may have been held by another thread at the fork."""
    global _owner_lock
    _owner_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shm_dir() -> str:
    """Where Xavier's shared-memory files go: ``/dev/shm``, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def owned_name(directory: Optional[str] = None) -> str:
    """A fresh path for a file this process creates in ``directory`` (default
    :func:`shm_dir`), tied to its owner lock (made on first use, per process: a forked
    child gets its own)."""
    directory = directory or shm_dir()
    return os.path.join(directory, f"xavier-{os.getpid()}-{_owner_token(directory)}"
                                   f"{secrets.token_hex(8)}")


def _owner_token(directory: str) -> str:
    key = (os.getpid(), directory)
    with _owner_lock:
        if key not in _owners:
            token = secrets.token_hex(8)
            final = os.path.join(directory, f"xavier-{key[0]}-{token}.owner")
            part = final + ".part"  # locked before it can be seen under its name
            fd = os.open(part, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(part, final)
            _owners[key] = (token, fd)
        return _owners[key][0]


def owner_alive(directory: str, pid: int, token: str) -> Optional[bool]:
    """Whether the owner of token ``token`` still holds its lock: True (alive), False (dead:
    its lock is free, and is removed here), None (no owner lock: a file of an older
    version)."""
    path = os.path.join(directory, f"xavier-{pid}-{token}.owner")
    try:
        fd = os.open(path, os.O_RDONLY)  # flock needs no write access
    except FileNotFoundError:
        return None
    except OSError:  # not ours to judge (another user's, say): taken for alive
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)


def remove_files(paths: Sequence[str]) -> None:
    """Unlink ``paths``; one already gone is no error (a sweep, or a second close)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class ShmWords:
    """``words``: the file's ``int64`` words as this process maps them."""

    def __init__(self, path: str, mapping: mmap.mmap, count: int, owner: bool) -> None:
        self.path = path
        self._mmap = mapping
        self._owner = owner
        self.words: np.ndarray = np.frombuffer(mapping, dtype=np.int64, count=count)

    @classmethod
    def create(cls, count: int, directory: Optional[str] = None,
               reserve: bool = False) -> ShmWords:
        """A new file of ``count`` zero words, owned here (:meth:`close` removes it).
        ``reserve``: its pages are allocated now (``OSError`` if the file system has no
        room), not at a first write that would then kill the process (SIGBUS on tmpfs)."""
        path = owned_name(directory)
        with open(path, "wb") as f:
            f.truncate(8 * count)
            if reserve:
                try:
                    os.posix_fallocate(f.fileno(), 0, 8 * count)
                except OSError:
                    f.close()
                    os.unlink(path)
                    raise
        return cls._map(path, count, owner=True)

    @classmethod
    def open(cls, path: str, count: int,
             check: Optional[Callable[[os.stat_result], None]] = None) -> ShmWords:
        """Map another process's file (closing it leaves the file).  ``check``: called with
        the opened file's status (a symlink is then refused, not followed), may raise."""
        return cls._map(path, count, owner=False, check=check)

    @classmethod
    def _map(cls, path: str, count: int, owner: bool,
             check: Optional[Callable[[os.stat_result], None]] = None) -> ShmWords:
        fd = os.open(path, os.O_RDWR | (os.O_NOFOLLOW if check is not None else 0))
        try:
            if check is not None:
                check(os.fstat(fd))
            mapping = mmap.mmap(fd, 8 * count)
        finally:
            os.close(fd)
        return cls(path, mapping, count, owner)

    @property
    def owned(self) -> bool:
        """Whether this process created the file (and removes it on :meth:`close`)."""
        return self._owner

    def close(self) -> None:
        """Unmap (and, for the owner, remove the file); :attr:`words` then reads zeros.
        Views taken from :attr:`words` keep the mapping until they are gone.  Idempotent."""
        words, self.words = self.words, np.zeros(len(self.words), np.int64)
        del words
        with contextlib.suppress(BufferError, ValueError):
            self._mmap.close()
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
