"""Which bytes a storage slot holds, in a file every reader of the host maps.

Step 3 of ``doc/validated-reads.md``: a read of a peer's slot must be checked after the
copy against the identity it was promised (the directory's row), not against
bookkeeping that a restart or a missed update can leave stale.  The identity is two
words:

* the storage's *incarnation*: 63 random bits minted for each :class:`SlotGenerations`
  (one per ``SnapshotStorage``: per engine registration and TP shard), so that a slot of
  a restarted source never passes for the slot of the same number before;
* a generation per ``(tier, group, slot)``, bumped by the writer (the worker's
  :class:`~..planning.slot_allocator.SlotAllocator`) *before* new bytes go into the slot,
  so that a reader whose copy overlapped the write sees another generation afterwards.

The file is a header (format word, incarnation) and one ``int64`` per slot, row after row
(one row per tier and group): aligned 8-byte words, so a reader never sees a torn value.
The owner (the rank's ``TransferActor``, through its storage) creates it and removes it on
:meth:`SlotGenerations.close`; the worker and the peers of this host map it
(:meth:`SlotGenerations.open` from :meth:`SlotGenerations.handle`).  Its name is the
storage's (``xavier-<pid>-<hex>``), so that the sweep of orphaned files removes it too.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np

#: first word of the file: what it is (and its format's version)
FORMAT = 0x5841564745_4E0001  # "XAVGEN", 1
_HEADER_WORDS = 2

#: ``(path, incarnation, [(tier, group, first word, slots)])``
GenerationsHandle = Tuple[str, int, List[Tuple[int, int, int, int]]]


class SlotGenerations:
    """The incarnation and the slot generations of one storage (module docstring)."""

    def __init__(self, path: str, mapping: mmap.mmap, words: np.ndarray,
                 rows: Dict[Tuple[int, int], Tuple[int, int]], owner: bool) -> None:
        self.path = path
        self._mmap = mapping
        self._words = words
        self._rows = dict(rows)
        self._owner = owner

    @classmethod
    def create(cls, slots: Dict[Tuple[int, int], int],
               directory: Optional[str] = None) -> SlotGenerations:
        """A new file for ``slots`` (``(tier, group) -> slots``), every generation 0, a
        fresh incarnation."""
        if not slots or any(n < 1 for n in slots.values()):
            raise ValueError(f"slots: every (tier, group) needs at least one slot, got {slots}")
        from .snapshot_storage import shm_dir

        rows: Dict[Tuple[int, int], Tuple[int, int]] = {}
        offset = _HEADER_WORDS
        for key in sorted(slots):
            rows[key] = (offset, int(slots[key]))
            offset += int(slots[key])
        path = os.path.join(directory or shm_dir(), f"xavier-{os.getpid()}-{uuid.uuid4().hex}")
        with open(path, "wb") as f:
            f.truncate(8 * offset)
        gens = cls._map(path, rows, owner=True)
        gens._words[1] = secrets.randbits(63) or 1
        gens._words[0] = FORMAT
        return gens

    @classmethod
    def open(cls, handle: GenerationsHandle) -> SlotGenerations:
        """Map another process's file from its :meth:`handle` (not the owner: closing it
        leaves the file).  A file of another format or incarnation is an error naming it."""
        path, incarnation, layout = handle
        rows = {(int(t), int(g)): (int(first), int(n)) for t, g, first, n in layout}
        gens = cls._map(path, rows, owner=False)
        if int(gens._words[0]) != FORMAT or gens.incarnation != int(incarnation):
            found = (int(gens._words[0]), gens.incarnation)
            gens.close()
            raise ValueError(f"generations: {path} holds format/incarnation {found}, "
                             f"expected {(FORMAT, int(incarnation))}")
        return gens

    @classmethod
    def _map(cls, path: str, rows: Dict[Tuple[int, int], Tuple[int, int]],
             owner: bool) -> SlotGenerations:
        words = _HEADER_WORDS + sum(n for _, n in rows.values())
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 8 * words)
        return cls(path, mapping, np.frombuffer(mapping, dtype=np.int64, count=words), rows,
                   owner)

    @property
    def incarnation(self) -> int:
        return int(self._words[1])

    def handle(self) -> GenerationsHandle:
        return (self.path, self.incarnation,
                [(t, g, first, n) for (t, g), (first, n) in sorted(self._rows.items())])

    def row(self, tier: int, group: int) -> np.ndarray:
        """The generations of ``tier``/``group``'s slots: a writable view of the file."""
        first, n = self._rows[(int(tier), int(group))]
        return self._words[first:first + n]

    def close(self) -> None:
        """Unmap (and, for the owner, remove the file).  Views from :meth:`row` must be
        gone first; a mapping still viewed stays until they are.  Idempotent."""
        words, self._words = self._words, np.zeros(_HEADER_WORDS, np.int64)
        del words
        with contextlib.suppress(BufferError, ValueError):
            self._mmap.close()
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
