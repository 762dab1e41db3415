"""Blocks of another host's storage, moved with xoscar's ``copy_to``.

The loading rank's transfer actor registers staging rows as xoscar buffer refs and asks
the source rank's transfer actor to send the requested slots into them
(:func:`fetch_into`); the source gathers the slots (one contiguous ``uint8`` buffer per
layer) and calls ``xo.copy_to`` once for all layers of the transfer (:func:`serve_blocks`).
``copy_to`` picks its channel from the address in the buffer refs: NIXL for a ``nixl://``
address (:mod:`.nixl_endpoint`), the pools' sockets otherwise.  The staging rows live in
shared memory that the loading worker maps too: it writes them into its KV cache once the
fetch returned.  Transfer sizes are bounded by the slab: one call per planned transfer.

A fetch whose caller gave up (the worker's call timed out) can still write: xoscar 0.12
cancels the actor's coroutine remotely without waiting, and on sockets the blocks of a
cancelled ``copy_to`` already sent keep arriving and are written into whatever buffer is
registered under their refs (``doc/results/xoscar-late-write/``).  Two guards keep such a
late write out of the rows the worker reads next:

* a fetch holds its rows for its whole call (:meth:`StagingSets.taken`); one that comes
  while another still runs (only possible after a timeout: the worker makes one call at a
  time) takes a second set of rows, allocated then; with both in use it is refused;
* when a fetch's call ends, its buffer refs are forgotten (:func:`forget_buffer_refs`), so
  a block that arrives later finds no buffer and writes nothing.

On sockets, the rows count what was written into them (:class:`CountedRows`): a fetch the
source answered but whose blocks did not all land fails instead of returning other bytes.

NIXL needs only the first: its ``copy_buffers`` waits for the WRITE before it re-raises a
cancellation, and the loader's call ends only after the source answered.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, NamedTuple, Protocol, Sequence, Set

import numpy as np
import torch
import xoscar as xo
from xoscar.core import BufferRef

from ..planning.load_batch import Tier
from ..planning.shm_words import remove_files
from .kv_schema import KVLayout
from .nixl_endpoint import NIXL_SCHEME
from .slot_generations import SlotGenerations
from .snapshot_storage import ShmHandles, new_shm_tensor


class RemoteFetchError(RuntimeError):
    """A fetch that must not be used (the load is recomputed); ``counter`` names the
    transfer actor's counter of such fetches."""

    counter = "remote_fetch_errors"


class IncompleteFetchError(RemoteFetchError):
    """The source answered a fetch, but not every staging row was written: the rows hold
    other bytes (the load is recomputed)."""

    counter = "remote_fetches_incomplete"


class CountedRows:
    """Staging rows of one layer as xoscar's sockets channel writes them
    (``rows[start:stop] = data``), counting the rows written.  xoscar 0.12's ``copy_to``
    over sockets ignores the receiving pool's answer to each block, so a block that pool
    could not write (an unknown ref, data it cannot assign) goes unnoticed by the source,
    which still answers with its byte count; the count is how the loader knows."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.written = 0

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __setitem__(self, index: slice, data: Any) -> None:
        self.rows[index] = data
        start, stop, _ = index.indices(len(self))
        self.written += max(0, stop - start)


class ServedBlocks(NamedTuple):
    """The source's answer to a fetch: the bytes it sent, and what its slots held once it
    had gathered them (its storage's incarnation, each slot's generation, in the fetch's
    order; 0 and empty for a storage that keeps none): the loader checks them against
    what its rows were promised (:mod:`.read_checks`)."""

    bytes: int
    incarnation: int
    generations: List[int]


async def fetch_into(source: Any, address: str, tier: int, group: int, slots: Sequence[int],
                     staging_rows: List[torch.Tensor], tp_rank: int = 0) -> ServedBlocks:
    """Loader side: have ``source`` (an actor ref exposing ``serve_blocks``) write
    ``slots`` of its shard ``tp_rank``'s ``tier``/``group`` into ``staging_rows`` (per
    layer ``uint8`` ``[len(slots), block_bytes]``), received at ``address``.  Returns the
    source's answer; ``IncompleteFetchError`` when the sockets channel did not write every
    row (:class:`CountedRows`; NIXL's channel reports its own failures)."""
    counted = ([CountedRows(rows) for rows in staging_rows]
               if not address.startswith(NIXL_SCHEME) else None)
    # the rows must stay alive until copy_to has written them: they do, in this frame
    refs = [xo.buffer_ref(address, rows) for rows in (counted or staging_rows)]
    try:
        served = ServedBlocks(*await source.serve_blocks(int(tier), int(group), list(slots),
                                                         refs, int(tp_rank)))
    finally:
        forget_buffer_refs(refs)
    if counted is not None and any(c.written != len(c) for c in counted):
        raise IncompleteFetchError(
            f"fetch of {len(slots)} slots: rows written per layer "
            f"{[c.written for c in counted]}, expected {len(slots)} each (the receiving "
            "pool could not write every block)")
    return served


def forget_buffer_refs(refs: Sequence[Any]) -> None:
    """Unregister ``refs`` (xoscar keeps buffers by ref until they are garbage collected):
    a block of a cancelled ``copy_to`` that arrives later is refused (``KeyError`` in the
    receiving pool) instead of written into rows that another fetch may be using."""
    for ref in refs:
        BufferRef._ref_to_buffers.pop(ref, None)


class ServedSource(Protocol):
    """What serves a fetch: a snapshot storage, or a worker's vLLM cache read in place
    (:class:`~.in_place.InPlaceSource`)."""

    generations: SlotGenerations

    def gather_rows(self, tier: Tier, group: int,
                    slots: Sequence[int]) -> List[torch.Tensor]: ...


async def serve_blocks(storage: ServedSource, tier: int, group: int,
                       slots: Sequence[int], refs: Sequence[Any]) -> ServedBlocks:
    """Source side: send ``slots`` of ``tier``/``group`` into the loader's buffer refs.
    Returns the bytes sent and the slots' identity, read after the gather completed (a
    write that overlapped it bumped a generation first: the loader sees the change)."""
    slot_list = slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
    rows = storage.gather_rows(Tier(tier), group, slot_list)
    if len(rows) != len(refs):
        raise ValueError(f"refs: expected one buffer per layer ({len(rows)}), got {len(refs)}")
    gens = storage.generations
    identity = (gens.incarnation, gens.row(int(tier), group)[slot_list].tolist())
    await xo.copy_to(rows, list(refs))
    return ServedBlocks(sum(r.numel() for r in rows), *identity)


class StagingRows:
    """Per group and layer ``uint8 [rows, block_bytes]`` in shared memory: where reads from
    other hosts land for the worker, which maps them through :attr:`handles`.  Allocated
    by the rank's transfer actor; the files go on :meth:`close` (idempotent)."""

    def __init__(self, layout: KVLayout, rows: int) -> None:
        self.rows: Dict[int, List[torch.Tensor]] = {}
        self.handles: ShmHandles = {}
        self._files: List[str] = []
        try:
            for g in layout.groups:
                self.rows[g.group], self.handles[g.group] = [], []
                for la in g.layers:
                    shape = (rows, la.block_bytes)
                    path, t = new_shm_tensor(shape, torch.uint8)
                    self._files.append(path)
                    self.rows[g.group].append(t)
                    self.handles[g.group].append((path, str(t.dtype), shape))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.rows = {}
        remove_files(self._files)
        self._files = []


#: row sets one worker's fetches may hold at once (one running, one whose caller gave up)
MAX_STAGING_SETS = 2


class StagingBusyError(RemoteFetchError):
    """Every staging row set of the worker is held by a running fetch (two timed out in a
    row and still run): the load is refused (vLLM recomputes it)."""

    counter = "remote_fetches_refused"


class StagingSets:
    """One worker's staging rows: set 0 allocated now, a second only when a fetch comes
    while another still holds set 0 (see the module docstring).  The worker maps set 0 from
    :meth:`handles` at open and a later one when an answer first names it.  Lives in the
    transfer actor (one event loop: no lock).  :meth:`close` is idempotent."""

    def __init__(self, layout: KVLayout, rows: int) -> None:
        self._layout, self._rows = layout, rows
        self._sets: List[StagingRows] = [StagingRows(layout, rows)]
        self._busy: Set[int] = set()
        #: fetches that found set 0 busy (each one follows a call whose caller gave up)
        self.overlaps = 0

    @contextlib.contextmanager
    def taken(self) -> Iterator[int]:
        """Hold a free set for one fetch (its index); released when the fetch's call ends,
        however it ends.  ``StagingBusyError`` when every set is held."""
        index = self._acquire()
        try:
            yield index
        finally:
            self._busy.discard(index)

    def _acquire(self) -> int:
        free = [k for k in range(len(self._sets)) if k not in self._busy]
        if not free and len(self._sets) < MAX_STAGING_SETS:
            self._sets.append(StagingRows(self._layout, self._rows))
            free = [len(self._sets) - 1]
        if not free:
            raise StagingBusyError(f"all {len(self._sets)} staging row sets are held by "
                                   "fetches still running after their callers gave up")
        if self._busy:
            self.overlaps += 1
        self._busy.add(free[0])
        return free[0]

    def rows(self, index: int, group: int, n: int) -> List[torch.Tensor]:
        """Rows ``0..n-1`` of set ``index``, group ``group``, per layer."""
        return [s[:n] for s in self._sets[index].rows[group]]

    def handles(self, index: int = 0) -> ShmHandles:
        """How the worker maps set ``index``."""
        if not 0 <= index < len(self._sets):
            raise IndexError(f"staging set {index}: {len(self._sets)} allocated")
        return self._sets[index].handles

    def close(self) -> None:
        for rows in self._sets:
            rows.close()
        self._busy.clear()
