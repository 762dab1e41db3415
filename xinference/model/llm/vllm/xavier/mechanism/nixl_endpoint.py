"""A NIXL address for a transfer actor whose pool has none.

xoscar's ``copy_to`` picks its channel from the address of the receiving buffer refs:
bytes sent to a ``nixl://`` address travel through NIXL (one RDMA/UCX write per buffer),
to a plain address over the pool's sockets.  Xinference's worker creates every replica's
sub pool with a plain address, so a loader that registers its staging rows under its own
pool address would always receive over sockets.  :func:`open_nixl_endpoint` gives the
loader's process a second, NIXL-scheme address: an in-process xoscar pool without sub
pools, listening on the host of the rank's own (externally reachable) address.  Buffer refs
made for that address are received through NIXL; the buffers themselves are process-wide,
so the endpoint pool serves the transfer actor's staging rows without owning them.

Needs NIXL's Python package (``nixl``, on GPU machines ``nixl_cu12``/``nixl_cu13``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List

import xoscar as xo

from ..planning.log_names import package_logger

logger = package_logger(__name__)

NIXL_SCHEME = "nixl://"


def nixl_importable() -> bool:
    """NIXL's agent API can be imported in this process (xoscar's NIXL channel needs it)."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:
        return False
    return True


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> List[str]:
    """This host's RDMA devices (InfiniBand, RoCE; empty without any).  The automatic
    transport uses NIXL across hosts only where there is one: over plain TCP, UCX moves
    the bytes no faster than xoscar's sockets (measured on simulated hosts,
    doc/multi-host.md) and NIXL's progress thread keeps a CPU core busy in every process
    that holds an agent."""
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def endpoint_host(rank_address: str) -> str:
    """The host part of an xoscar address (``"10.0.0.5:3456"``, ``"nixl://h:1"``)."""
    address = rank_address.split("://", 1)[-1]
    host = address.rsplit(":", 1)[0]
    if not host:
        raise ValueError(f"rank_address: no host in {rank_address!r}")
    return host


@dataclass
class NixlEndpoint:
    """A NIXL-scheme address served in this process; ``address`` goes into buffer refs."""

    address: str
    pool: Any

    async def close(self) -> None:
        """Stop listening.  Idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.stop()


async def open_nixl_endpoint(rank_address: str) -> NixlEndpoint:
    """Listen on ``nixl://<host of rank_address>:<free port>`` in this process.  Raises
    ``RuntimeError`` when NIXL cannot be imported here."""
    if rank_address.startswith(NIXL_SCHEME):  # the pool itself speaks NIXL already
        return NixlEndpoint(rank_address, None)
    if not nixl_importable():
        raise RuntimeError("NIXL's Python package (nixl) cannot be imported in this process")
    pool = await xo.create_actor_pool(f"{NIXL_SCHEME}{endpoint_host(rank_address)}:0",
                                      n_process=0)
    logger.info("xavier: NIXL endpoint %s opened next to %s", pool.external_address,
                rank_address)
    return NixlEndpoint(pool.external_address, pool)
