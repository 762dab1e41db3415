"""Real xoscar actor pools with sub pools in separate (spawned) processes."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import AsyncIterator, List

import xoscar as xo

from .engines import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def actor_pool(n_process: int = 1,
                     scheme: str = "") -> AsyncIterator[xo.MainActorPoolType]:
    """A main pool on loopback with ``n_process`` spawned sub pools; ``scheme="nixl"``
    makes every pool use xoscar's NIXL channel (``copy_to`` then moves bytes with NIXL)."""
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    prefix = f"{scheme}://" if scheme else ""
    pool = await xo.create_actor_pool(f"{prefix}127.0.0.1:{free_port()}", n_process=n_process,
                                      subprocess_start_method="spawn")
    try:
        yield pool
    finally:
        await pool.stop()


def nixl_available() -> bool:
    """NIXL's Python API importable (xoscar's nixl channel needs it)."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:
        return False
    return True


def sub_pool_addresses(pool: xo.MainActorPoolType) -> List[str]:
    """Addresses of the sub pools (index 0 is the main pool itself)."""
    return list(pool._config.get_external_addresses())[1:]
