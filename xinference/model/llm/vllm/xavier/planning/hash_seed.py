"""One block-hash seed for every replica of a model.

vLLM V1 seeds its prefix-cache block hashes with ``NONE_HASH``, computed in
each engine-core process by ``init_none_hash``: from ``PYTHONHASHSEED`` when
it is set, else from ``os.urandom`` (measured on vLLM 0.27.1 / 0.26.0).
Without a shared seed, two replicas hash the same prefix differently and no
cross-replica hit is ever possible.  :func:`ensure_shared_hash_seed` is
called before an engine is built; vLLM's spawned processes inherit it.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping, Optional

logger = logging.getLogger(__name__)

ENV = "PYTHONHASHSEED"
#: used when the user did not choose a seed; any fixed value works if all replicas agree
DEFAULT_SEED = "0"


def ensure_shared_hash_seed(environ: Optional[MutableMapping[str, str]] = None) -> str:
    """Set ``PYTHONHASHSEED`` to :data:`DEFAULT_SEED` unless a fixed value is set;
    returns the seed in force.  ``"random"`` is refused: it defeats sharing."""
    env = os.environ if environ is None else environ
    value = env.get(ENV)
    if value is None or value == "":
        env[ENV] = DEFAULT_SEED
        logger.info("xavier: %s set to %s so that replicas hash blocks alike", ENV, DEFAULT_SEED)
        return DEFAULT_SEED
    if value == "random":
        raise ValueError(f"{ENV}: 'random' gives every replica different block hashes; "
                         "unset it or use a fixed integer")
    return value
