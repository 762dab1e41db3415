"""Transport selection, as Xinference 3.5.0 core calls it.

``normalize_xavier_transport_backend`` runs in the supervisor for EVERY
non-sharded launch (any engine), so it is pure and cheap.  ``None`` or ``""``
gives ``"xavier"`` (core's default behaviour).  Whatever it raises fails the
launch, which is what a bad ``vllm_transfer_backend_type`` should do.
"""

from __future__ import annotations

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


def normalize_xavier_transport_backend(backend: Optional[str]) -> str:
    """Canonical transport name; raises ``ValueError`` naming the option for a bad value."""
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


def get_xavier_transport_backend(xavier_config: Optional[Dict[str, Any]]) -> str:
    """The transport named in ``xavier_config`` (either key), normalized."""
    if not xavier_config:
        return XAVIER_TRANSPORT_XAVIER
    return normalize_xavier_transport_backend(
        xavier_config.get(XAVIER_TRANSPORT_BACKEND_KEY,
                          xavier_config.get(XAVIER_TRANSPORT_BACKEND_ALIAS_KEY)))


def host_id() -> str:
    """Same value in every process of one booted host (peers compare it to decide whether
    they can map each other's memory)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
