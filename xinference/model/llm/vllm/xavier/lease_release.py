"""Coalesced lease releases: one directory call for every release asked in one loop tick.

:class:`~.gpu_transfer.GPUTransfer` releases a step's leases one by one (concurrently, so
that one failure cannot keep the others); a step of 512 loaded blocks holds 512 leases.
:class:`CoalescingReleaser` turns those concurrent calls into ONE ``release(ids)`` call to
the block directory: each caller's await completes when that call does, and fails with its
error.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, List, Optional, Sequence, Set, Tuple

ReleaseIds = Callable[[Sequence[int]], Awaitable[object]]


class CoalescingReleaser:
    def __init__(self, release_ids: ReleaseIds) -> None:
        """``release_ids``: the directory's batched release (e.g. ``tracker.release``)."""
        self._release_ids = release_ids
        self._pending: List[Tuple[int, asyncio.Future[None]]] = []
        self._scheduled = False
        self._flushes: Set[asyncio.Task[Any]] = set()  # strong refs while they run
        self.calls = 0  # directory calls made (for tests and figures)

    async def release(self, lease_id: int) -> None:
        """Release one lease; returns (or raises) when the coalesced call has."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append((int(lease_id), fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._start_flush)
        await fut

    def _start_flush(self) -> None:
        task = asyncio.ensure_future(self._flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        batch, self._pending, self._scheduled = self._pending, [], False
        error: Optional[BaseException] = None
        try:
            self.calls += 1
            await self._release_ids([lease_id for lease_id, _ in batch])
        except Exception as exc:
            error = exc
        for _, fut in batch:
            if fut.done():  # its caller was cancelled
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
