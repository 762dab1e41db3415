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

import secrets
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..planning.shm_words import ShmWords

#: first word of the file: what it is (and its format's version)
FORMAT = 0x5841564745_4E0001  # "XAVGEN", 1
_HEADER_WORDS = 2

#: ``(path, incarnation, [(tier, group, first word, slots)])``
GenerationsHandle = Tuple[str, int, List[Tuple[int, int, int, int]]]


class SlotGenerations:
    """The incarnation and the slot generations of one storage (module docstring)."""

    def __init__(self, shm: ShmWords, rows: Dict[Tuple[int, int], Tuple[int, int]]) -> None:
        self.path = shm.path
        self._shm = shm
        self._rows = dict(rows)

    @classmethod
    def create(cls, slots: Dict[Tuple[int, int], int],
               directory: Optional[str] = None) -> SlotGenerations:
        """A new file for ``slots`` (``(tier, group) -> slots``), every generation 0, a
        fresh incarnation."""
        if not slots or any(n < 1 for n in slots.values()):
            raise ValueError(f"slots: every (tier, group) needs at least one slot, got {slots}")
        rows: Dict[Tuple[int, int], Tuple[int, int]] = {}
        offset = _HEADER_WORDS
        for key in sorted(slots):
            rows[key] = (offset, int(slots[key]))
            offset += int(slots[key])
        return cls._stamped(ShmWords.create(offset, directory), rows)

    @classmethod
    def _stamped(cls, shm: ShmWords, rows: Dict[Tuple[int, int], Tuple[int, int]]
                 ) -> SlotGenerations:
        """A new file's header written: a fresh incarnation, then the format word."""
        gens = cls(shm, rows)
        gens._shm.words[1] = secrets.randbits(63) or 1
        gens._shm.words[0] = FORMAT
        return gens

    @classmethod
    def create_shared(cls, tier: int, groups: Sequence[int], slots: int,
                      directory: Optional[str] = None) -> SlotGenerations:
        """A new file of ONE row of ``slots`` generations that every group of ``groups``
        reads (``row(tier, g)`` is the same words for each): vLLM's KV cache read in place,
        whose block ids are one space for every KV-cache group (one ``BlockPool``), so a
        block handed out in one group is a new generation in all of them."""
        if slots < 1 or not groups:
            raise ValueError(f"slots: need at least one slot and one group, got {slots}, "
                             f"{list(groups)}")
        rows = {(int(tier), int(g)): (_HEADER_WORDS, int(slots)) for g in groups}
        return cls._stamped(ShmWords.create(_HEADER_WORDS + int(slots), directory), rows)

    @classmethod
    def open(cls, handle: GenerationsHandle) -> SlotGenerations:
        """Map another process's file from its :meth:`handle` (not the owner: closing it
        leaves the file).  A file of another format or incarnation is an error naming it."""
        path, incarnation, layout = handle
        rows = {(int(t), int(g)): (int(first), int(n)) for t, g, first, n in layout}
        words = max(first + n for first, n in rows.values())  # rows may share words
        gens = cls(ShmWords.open(path, words), rows)
        if int(gens._shm.words[0]) != FORMAT or gens.incarnation != int(incarnation):
            found = (int(gens._shm.words[0]), gens.incarnation)
            gens.close()
            raise ValueError(f"generations: {path} holds format/incarnation {found}, "
                             f"expected {(FORMAT, int(incarnation))}")
        return gens

    @property
    def incarnation(self) -> int:
        """The storage's incarnation (0 once closed: nothing matches it)."""
        return int(self._shm.words[1])

    def handle(self) -> GenerationsHandle:
        return (self.path, self.incarnation,
                [(t, g, first, n) for (t, g), (first, n) in sorted(self._rows.items())])

    def row(self, tier: int, group: int) -> np.ndarray:
        """The generations of ``tier``/``group``'s slots: a writable view of the file."""
        first, n = self._rows[(int(tier), int(group))]
        return self._shm.words[first:first + n]

    def close(self) -> None:
        """Unmap (and, for the owner, remove the file).  Views from :meth:`row` must be
        gone first; a mapping still viewed stays until they are.  Idempotent."""
        self._shm.close()
