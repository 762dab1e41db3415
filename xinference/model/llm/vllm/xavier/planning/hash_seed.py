"""One secret block-hash seed per launch, shared by every replica of the model.

vLLM V1 seeds its prefix-cache block hashes with ``NONE_HASH``, computed in each
engine-core process by ``init_none_hash``: from ``PYTHONHASHSEED`` when it is set, else
from ``os.urandom`` (vLLM 0.26.0 / 0.27.1).  Replicas must agree on it, or no block is
ever shared; outsiders should not know it (vLLM made it random after CVE-2025-25183: a
known seed lets anyone compute block hashes offline).

So a launch's block directory draws a secret seed (:func:`new_launch_seed`, from
``secrets``) when it is created; each replica's engine core fetches it from there before
vLLM computes ``NONE_HASH`` and seeds ``NONE_HASH`` with it
(:mod:`~..vllm_side.none_hash`).  The seed is never logged, never put in an environment
variable and never passed through vLLM's configuration (which vLLM logs); Python's own
hash randomization stays as the user had it.

A user who sets ``PYTHONHASHSEED`` to a fixed value for the launch keeps it (vLLM derives
``NONE_HASH`` from it in every replica alike): weaker, since that value is known wherever
the launch's settings are (:func:`user_seed`).  ``random`` is refused: it defeats sharing.
"""

from __future__ import annotations

import os
import secrets
from typing import Mapping, Optional

ENV = "PYTHONHASHSEED"
#: bytes of entropy of a launch's seed
SEED_BYTES = 32


def new_launch_seed() -> str:
    """A fresh secret seed (hex text, as vLLM hashes ``PYTHONHASHSEED``'s text)."""
    return secrets.token_hex(SEED_BYTES)


def user_seed(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The fixed ``PYTHONHASHSEED`` the user set for the launch, or None (Xavier's secret
    seed then applies).  ``"random"`` is refused: every replica would hash alike only by
    chance."""
    env = os.environ if environ is None else environ
    value = env.get(ENV)
    if value is None or value == "":
        return None
    if value == "random":
        raise ValueError(f"{ENV}: 'random' gives every replica different block hashes; "
                         "unset it (Xavier then draws a secret seed per launch) or use a "
                         "fixed integer")
    return value
