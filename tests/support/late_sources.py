"""A source rank whose ``copy_to`` is still writing after its caller gave up: the fault
behind the late-write guards of ``mechanism/remote_fetch.py``.

A real source's blocks are late only when a fetch is slow enough to time out (a loaded
host, a slow link; ``doc/results/xoscar-late-write/`` measured it with xoscar's own
sockets channel, where it happened in some trials).  This actor makes it certain: it
stands in for ``TransferActor.serve_blocks`` of a rank (same signature, same uid), fills
every row with one byte, and where the real one is merely slow, it holds the call until
its caller cancels and then still writes a block into the caller's buffer refs:

* ``"fast"``: writes at once and answers ``answer_s`` later (an ordinary source whose
  answer takes a while: it gives a late block of another call time to land before the
  loader reads);
* ``"while_running"``: on cancellation, waits ``late_s`` and writes before re-raising (a
  block that lands while the loader's call still runs: trial 3 of the experiment);
* ``"after_end"``: re-raises at once and writes ``late_s`` later from a task of its own (a
  block that lands after the loader's call ended: 4.7 ms after it in the experiment).

:meth:`late_outcome` says whether the late block reached the loader's pool:
``"answered"`` once the receiving pool answered it (xoscar 0.12's ``copy_to`` does not
raise when that pool could not write it: whether the bytes landed shows only in the rows),
or the error of the sending side.
"""

from __future__ import annotations

import asyncio
from typing import Any, List, Optional, Sequence

import numpy as np
import torch
import xoscar as xo


class LateWritingSource(xo.StatelessActor):
    def __init__(self, fill: int, mode: str, block_bytes: int, late_s: float = 0.5,
                 answer_s: float = 0.0, numpy_rows: bool = False) -> None:
        super().__init__()
        #: send numpy arrays, which the receiving pool cannot assign into the loader's
        #: torch rows (``TypeError`` there, which xoscar 0.12's ``copy_to`` over sockets
        #: does not report back): a source whose blocks do not land
        self._numpy_rows = numpy_rows
        self._fill, self._mode, self._late_s, self._answer_s = fill, mode, late_s, answer_s
        self._block_bytes = block_bytes
        self._outcome: Optional[str] = None
        self._late: Optional[asyncio.Task[None]] = None

    async def serve_blocks(self, tier: int, group: int, slots: Sequence[int],
                           refs: Sequence[Any], tp_rank: int = 0) -> int:
        """Rows of ``fill`` for ``slots`` into ``refs`` (one per layer), as ``mode`` says."""
        shape = (len(slots), self._block_bytes)  # as the real one gathers: [rows, bytes]
        rows: List[Any] = [np.full(shape, self._fill, np.uint8) if self._numpy_rows
                           else torch.full(shape, self._fill, dtype=torch.uint8) for _ in refs]
        if self._mode == "fast":
            await xo.copy_to(rows, list(refs))
            await asyncio.sleep(self._answer_s)
            return shape[0] * shape[1] * len(refs)
        try:
            await asyncio.sleep(3600)  # held until the caller gives up
        except asyncio.CancelledError:
            if self._mode == "while_running":
                await asyncio.shield(self._write_late(rows, refs))
            else:
                self._late = asyncio.create_task(self._write_late(rows, refs))
            raise
        return 0

    async def _write_late(self, rows: List[Any], refs: Sequence[Any]) -> None:
        await asyncio.sleep(self._late_s)
        try:
            await xo.copy_to(rows, list(refs))
            self._outcome = "answered"
        except Exception as exc:
            self._outcome = f"failed: {exc!r}"

    async def late_outcome(self) -> Optional[str]:
        if self._late is not None:
            await self._late
        return self._outcome
