"""The check of every read, after its copy: were the bytes the block they were named for?

Step 6 of ``doc/validated-reads.md``.  A transfer carries the identity its reads were
promised by the directory (:class:`~..planning.plan.Transfer`: the storage's incarnation,
each slot's generation at publication).  Once the copy has COMPLETED, the loader reads the
source's current identity of the same slots (:mod:`.slot_generations`: the storage's file,
mapped on this host; across hosts the source reads it after its gather and sends it with
the bytes).  The source bumps a slot's generation before anything writes the slot, so an
overwrite that began before the copy ended is seen here; a slot whose identity changed was
read while it held something else, and its destinations are failed blocks (vLLM recomputes
them).  A bookkeeping slip (a restarted source, a missed world update, a re-created
directory) thereby costs a miss, never wrong KV.

Pure numpy: the caller reads the identity, this module only compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..planning.plan import Transfer


@dataclass(frozen=True)
class SourceIdentity:
    """What the source holds now in a transfer's slots: its storage's incarnation and the
    generation of each of ``src_slots`` (in their order)."""

    incarnation: int
    generations: np.ndarray


@dataclass(frozen=True)
class ReadCheck:
    """The outcome for one transfer: the destinations whose read did not hold, and how many
    of its source rows failed (``stale_mapping``: the whole storage is another
    incarnation than the rows name; the loader's mapping of it may be stale)."""

    failed_blocks: np.ndarray
    failed_rows: int
    stale_mapping: bool = False

    @property
    def ok(self) -> bool:
        return self.failed_rows == 0


NO_FAILURE = ReadCheck(np.zeros(0, np.int64), 0)


def check_read(t: Transfer, now: Optional[SourceIdentity]) -> Optional[ReadCheck]:
    """Compare ``t``'s promised identity with the source's ``now`` (read after the copy
    completed).  None when the read cannot be checked: the transfer names no identity, or
    the storage keeps none (a storage mapped without its generations, in tests of the copy
    path)."""
    if t.src_generations is None or now is None:
        return None
    if now.incarnation != t.incarnation:
        return ReadCheck(t.dst_blocks.copy(), t.rows, stale_mapping=True)
    if now.generations.shape != t.src_generations.shape:
        raise ValueError(f"generations: expected {t.rows} (one per source slot), "
                         f"got shape {now.generations.shape}")
    bad = now.generations != t.src_generations
    if not bad.any():
        return NO_FAILURE
    return ReadCheck(t.dst_blocks[bad[t.dst_rows]], int(bad.sum()))
