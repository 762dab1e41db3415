"""A source rank whose ``copy_to`` is still writing after its caller gave up: the fault
behind the late-write guards of ``mechanism/remote_fetch.py``.

A real source's blocks are late only when a fetch is slow enough to time out (a loaded
host, a slow link; ``doc/results/xoscar-late-write/`` measured it with xoscar's own
sockets channel, where it happened in some trials).  This actor makes it certain, and
puts the late block exactly where it hurts: after the next fetch's bytes landed and before
the loader reads them.  It stands in for ``TransferActor.serve_blocks`` of a rank (same
signature, same uid) and fills every row with one byte:

* ``"fast"``: writes at once; given ``then`` (the late source's ref), it has that source
  write its late block (:meth:`LateWritingSource.write_late_now`) before it answers;
* ``"while_running"``: holds the call until its caller cancels it, then keeps the
  cancelled call running (shielded) until asked to write, writes, and re-raises (a block
  that lands while the loader's call still runs: trial 3 of the experiment);
* ``"after_end"``: on cancellation re-raises at once and writes later, when asked, from a
  task of its own (a block that lands after the loader's call ended: 4.7 ms after it in
  the experiment).

:meth:`write_late_now` answers whether the late block reached the loader's pool:
``"answered"`` once the receiving pool answered it (xoscar 0.12's ``copy_to`` does not
raise when that pool could not write it: whether the bytes landed shows only in the rows),
or the error of the sending side.
"""

from __future__ import annotations

import asyncio
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
import xoscar as xo

#: longest the sources wait for each other (a test that hangs fails instead)
WAIT_S = 60.0


class LateWritingSource(xo.StatelessActor):
    def __init__(self, fill: int, mode: str, block_bytes: int, then: Any = None,
                 numpy_rows: bool = False) -> None:
        super().__init__()
        self._fill, self._mode, self._block_bytes, self._then = fill, mode, block_bytes, then
        #: send numpy arrays, which the receiving pool cannot assign into the loader's
        #: torch rows (``TypeError`` there, which xoscar 0.12's ``copy_to`` over sockets
        #: does not report back): a source whose blocks do not land
        self._numpy_rows = numpy_rows
        #: the cancelled call's rows and buffer refs, until its late block is written
        self._late: Optional[Tuple[List[Any], List[Any]]] = None
        self._cancelled, self._go, self._written = (asyncio.Event(), asyncio.Event(),
                                                    asyncio.Event())
        #: a held call is inside its wait (cancelling it now reaches the late path)
        self._entered = asyncio.Event()
        self._outcome: Optional[str] = None

    async def serve_blocks(self, tier: int, group: int, slots: Sequence[int],
                           refs: Sequence[Any], tp_rank: int = 0) -> Tuple[int, int, List[int]]:
        """Rows of ``fill`` for ``slots`` into ``refs`` (one per layer), as ``mode`` says;
        answered like ``serve_blocks`` (bytes, incarnation 0 and no generations: a source
        that keeps no identity)."""
        shape = (len(slots), self._block_bytes)  # as the real one gathers: [rows, bytes]
        rows: List[Any] = [np.full(shape, self._fill, np.uint8) if self._numpy_rows
                           else torch.full(shape, self._fill, dtype=torch.uint8) for _ in refs]
        if self._mode == "fast":
            await xo.copy_to(rows, list(refs))
            if self._then is not None:
                await self._then.write_late_now()
            return shape[0] * shape[1] * len(refs), 0, []
        try:
            self._entered.set()
            await asyncio.sleep(3600)  # held until the caller gives up
        except asyncio.CancelledError:
            self._late = (rows, list(refs))
            self._cancelled.set()
            if self._mode == "while_running":
                await asyncio.shield(self._write_when_asked())
            else:
                asyncio.create_task(self._write_when_asked())
            raise
        return 0, 0, []

    async def _write_when_asked(self) -> None:
        try:
            await asyncio.wait_for(self._go.wait(), WAIT_S)
            assert self._late is not None
            await xo.copy_to(*self._late)
            self._outcome = "answered"
        except Exception as exc:
            self._outcome = f"failed: {exc!r}"
        finally:
            self._late = None
            self._written.set()

    async def write_late_now(self) -> Optional[str]:
        """Once a call was cancelled: write its late block now and return the outcome
        (ready for the next cancelled call after)."""
        await asyncio.wait_for(self._cancelled.wait(), WAIT_S)
        self._go.set()
        await asyncio.wait_for(self._written.wait(), WAIT_S)
        for event in (self._cancelled, self._go, self._written):
            event.clear()
        return self._outcome

    async def wait_entered(self) -> None:
        """Until a call is held (then ready for the next one)."""
        await asyncio.wait_for(self._entered.wait(), WAIT_S)
        self._entered.clear()

    def outcome(self) -> Optional[str]:
        """What the last late block did (see the module docstring)."""
        return self._outcome
