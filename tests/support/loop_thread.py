"""An asyncio loop in a background thread, so one set of actor pools can serve several tests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 900.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


async def enter(cm: Any) -> Any:
    return await cm.__aenter__()


async def leave(cm: Any) -> Awaitable[Any]:
    return await cm.__aexit__(None, None, None)
