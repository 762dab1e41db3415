"""How a rank reaches a peer: transport names, host identity, the route per peer (pure).

Four transports (the launch option ``vllm_transfer_backend_type``): ``xavier`` (automatic:
map peers of this host; NIXL to other hosts where NIXL is importable and the host has an
RDMA device, else sockets), ``ipc`` (this host only), ``nixl`` (every peer through NIXL,
this host too) and ``sockets`` (map peers of this host, xoscar's sockets to other hosts:
NIXL is never opened).  :func:`peer_route` turns a transport and a peer's place into one
route; the worker maps ``ipc`` routes itself and asks its rank's transfer actor for the
others.
"""

from __future__ import annotations

import os
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

#: map peers of this host, other hosts over xoscar's sockets (NIXL switched off)
XAVIER_TRANSPORT_SOCKETS = "sockets"

SUPPORTED_TRANSPORTS = (XAVIER_TRANSPORT_XAVIER, XAVIER_TRANSPORT_IPC, XAVIER_TRANSPORT_NIXL,
                        XAVIER_TRANSPORT_SOCKETS)
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
    forced), :data:`ROUTE_NIXL` (forced, or another host and NIXL usable and not switched
    off) or :data:`ROUTE_SOCKETS`.  Raises ``LookupError`` when the ``ipc`` transport meets a peer
    on another host (it cannot be read)."""
    if same_host and transport != XAVIER_TRANSPORT_NIXL:
        return ROUTE_IPC
    if transport == XAVIER_TRANSPORT_IPC:
        raise LookupError("the peer is on another host and the transport is ipc")
    if transport == XAVIER_TRANSPORT_SOCKETS:
        return ROUTE_SOCKETS
    if transport == XAVIER_TRANSPORT_NIXL or nixl_usable:
        return ROUTE_NIXL
    return ROUTE_SOCKETS


def host_id() -> str:
    """Same value in every process that can map the same memory: one booted kernel, one
    host name, one network and one IPC namespace (peers compare it to decide whether they
    map each other's memory or read it over the network).  Containers or simulated hosts
    (``ip netns``) on one machine count as separate hosts: a conservative answer only
    costs speed, the wrong one would map memory that is not there."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    spaces = []
    for name in ("net", "ipc"):
        try:
            spaces.append(f"{name}:{os.stat(f'/proc/self/ns/{name}').st_ino}")
        except OSError:
            pass
    return "/".join([socket.gethostname(), boot] + spaces)
