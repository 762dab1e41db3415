"""Transport selection, as Xinference 3.5.0's supervisor calls it (adapter).

``normalize_xavier_transport_backend`` runs in the supervisor for EVERY non-sharded
launch (any engine), so it is pure and cheap: it loads nothing but
:mod:`.planning.routes`, where the transports and routes are defined.  Whatever it raises
fails the launch, which is what a bad ``vllm_transfer_backend_type`` should do.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .planning.routes import normalize_transport, transport_in_config


def normalize_xavier_transport_backend(backend: Optional[str]) -> str:
    """Xinference's hook: the canonical transport name (``None`` or ``""``: ``"xavier"``,
    core's default); ``ValueError`` naming ``vllm_transfer_backend_type`` otherwise."""
    return normalize_transport(backend)


def get_xavier_transport_backend(xavier_config: Optional[Dict[str, Any]]) -> str:
    """The transport named in a launch's ``xavier_config`` (either key), normalized."""
    return transport_in_config(xavier_config)
