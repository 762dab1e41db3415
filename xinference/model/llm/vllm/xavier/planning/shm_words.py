"""A file of ``int64`` words in shared memory: one process owns it, others of the host map it.

What :class:`~.counters.SharedCounters` (the worker's counters) and
:class:`~..mechanism.slot_generations.SlotGenerations` (a storage's slot identities) are
made of.  Aligned 8-byte words, so a reader never sees a torn value.  The file is named
``xavier-<pid>-<hex>`` in :func:`shm_dir`, so that the sweep of orphaned files removes it
when its owner died.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
from typing import Optional

import numpy as np


def shm_dir() -> str:
    """Where Xavier's shared-memory files go: ``/dev/shm``, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmWords:
    """``words``: the file's ``int64`` words as this process maps them."""

    def __init__(self, path: str, mapping: mmap.mmap, count: int, owner: bool) -> None:
        self.path = path
        self._mmap = mapping
        self._owner = owner
        self.words: np.ndarray = np.frombuffer(mapping, dtype=np.int64, count=count)

    @classmethod
    def create(cls, count: int, directory: Optional[str] = None) -> ShmWords:
        """A new file of ``count`` zero words, owned here (:meth:`close` removes it)."""
        path = os.path.join(directory or shm_dir(), f"xavier-{os.getpid()}-{uuid.uuid4().hex}")
        with open(path, "wb") as f:
            f.truncate(8 * count)
        return cls._map(path, count, owner=True)

    @classmethod
    def open(cls, path: str, count: int) -> ShmWords:
        """Map another process's file (closing it leaves the file)."""
        return cls._map(path, count, owner=False)

    @classmethod
    def _map(cls, path: str, count: int, owner: bool) -> ShmWords:
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 8 * count)
        return cls(path, mapping, count, owner)

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
