"""How a rank reaches a peer: transport names, host identity, the route per peer (pure).

Three transports (the launch option ``vllm_transfer_backend_type``): ``xavier`` (automatic:
map peers of this host, NIXL to other hosts when importable, else sockets), ``ipc`` (this
host only) and ``nixl`` (every peer through NIXL, this host too).  :func:`peer_route` turns
a transport and a peer's place into one route; the worker maps ``ipc`` routes itself and
asks its rank's transfer actor for the others.
"""

from __future__ import annotations

import socket
from typing import Any, Dict, Optional

XAVIER_TRANSPORT_BACKEND_KEY = "vllm_transfer_backend_type"
XAVIER_TRANSPORT_BACKEND_ALIAS_KEY = "transfer_backend_type"

#: automatic choice: CUDA IPC / shared memory on one host, NIXL across hosts
XAVIER_TRANSPORT_XAVIER = "xavier"
#: force one-host mappings (CUDA IPC for the GPU tier, shared memory for the CPU tier)
XAVIER_TRANSPORT_IPC = "ipc"
#: force NIXL through xoscar even on one host
XAVIER_TRANSPORT_NIXL = "nixl"

SUPPORTED_TRANSPORTS = (XAVIER_TRANSPORT_XAVIER, XAVIER_TRANSPORT_IPC, XAVIER_TRANSPORT_NIXL)
_ALIASES = {"auto": XAVIER_TRANSPORT_XAVIER, "cuda_ipc": XAVIER_TRANSPORT_IPC}

#: the routes of :func:`peer_route`
ROUTE_IPC = "ipc"
ROUTE_NIXL = "nixl"
ROUTE_SOCKETS = "sockets"


def normalize_transport(backend: Optional[str]) -> str:
    """Canonical transport name; raises ``ValueError`` naming the option for a bad value.
    ``None`` or ``""`` gives ``"xavier"``."""
    if backend is None:
        return XAVIER_TRANSPORT_XAVIER
    if not isinstance(backend, str):
        raise ValueError(
            f"{XAVIER_TRANSPORT_BACKEND_KEY}: expected one of {', '.join(SUPPORTED_TRANSPORTS)}, "
            f"got {backend!r} ({type(backend).__name__})")
    name = backend.strip().lower()
    if name == "":
        return XAVIER_TRANSPORT_XAVIER
    name = _ALIASES.get(name, name)
    if name not in SUPPORTED_TRANSPORTS:
        raise ValueError(
            f"{XAVIER_TRANSPORT_BACKEND_KEY}: unknown transport {backend!r}; "
            f"expected one of {', '.join(SUPPORTED_TRANSPORTS)}")
    return name


def transport_in_config(xavier_config: Optional[Dict[str, Any]]) -> str:
    """The transport named in ``xavier_config`` (either key), normalized."""
    if not xavier_config:
        return XAVIER_TRANSPORT_XAVIER
    return normalize_transport(
        xavier_config.get(XAVIER_TRANSPORT_BACKEND_KEY,
                          xavier_config.get(XAVIER_TRANSPORT_BACKEND_ALIAS_KEY)))


def peer_route(transport: str, same_host: bool, nixl_usable: bool) -> str:
    """The route to one peer: :data:`ROUTE_IPC` (map its memory: same host, unless NIXL is
    forced), :data:`ROUTE_NIXL` (forced, or another host and NIXL usable) or
    :data:`ROUTE_SOCKETS`.  Raises ``LookupError`` when the ``ipc`` transport meets a peer
    on another host (it cannot be read)."""
    if same_host and transport != XAVIER_TRANSPORT_NIXL:
        return ROUTE_IPC
    if transport == XAVIER_TRANSPORT_IPC:
        raise LookupError("the peer is on another host and the transport is ipc")
    if transport == XAVIER_TRANSPORT_NIXL or nixl_usable:
        return ROUTE_NIXL
    return ROUTE_SOCKETS


def host_id() -> str:
    """Same value in every process of one booted host (peers compare it to decide whether
    they can map each other's memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
