"""vLLM's ``NONE_HASH`` from the launch's secret seed (engine-core process).

vLLM's ``EngineCore.__init__`` builds the scheduler (and with it the scheduler half of the
connector) and only then calls ``init_none_hash(hash_fn)``, which seeds ``NONE_HASH``
from ``PYTHONHASHSEED`` or ``os.urandom``; every request's block hashes are computed
later, when it is added.  :func:`seed_next_init` (called by the connector's scheduler
half, in that same ``__init__``) wraps that one call: vLLM's own ``init_none_hash`` runs,
then ``NONE_HASH`` becomes ``hash_fn(seed)`` -- what vLLM derives from
``PYTHONHASHSEED=seed`` -- without putting the seed into the process environment (where
the interpreter's own hash randomization and every child process would see it).  The
wrapper removes itself after its one call.

This reaches into one name of vLLM (``vllm.v1.engine.core.init_none_hash``, 0.26 and
0.27).  Where vLLM's shape differs, nothing is changed and a warning says so; the
connector then checks :func:`seeded_with` when the first request arrives and turns
sharing off for the engine (its hashes would match no other replica's).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from ..planning.log_names import package_logger

logger = package_logger(__name__)

#: the module whose global ``init_none_hash`` vLLM's EngineCore calls
CORE_MODULE = "vllm.v1.engine.core"

#: the seed the coming ``init_none_hash`` call applies, and the hash function it got
_pending: Optional[str] = None
_applied_fn: Optional[Callable[[Any], bytes]] = None


def seed_next_init(seed: str) -> bool:
    """Make vLLM's next ``init_none_hash`` in this process seed ``NONE_HASH`` from
    ``seed``.  Returns False (and changes nothing) when vLLM has no such call to wrap."""
    global _pending
    core: Any = importlib.import_module(CORE_MODULE)
    current = getattr(core, "init_none_hash", None)
    if not callable(current):
        logger.warning("xavier: %s has no init_none_hash (vLLM's shape differs): the "
                       "launch's block-hash seed cannot be applied", CORE_MODULE)
        return False
    _pending = seed
    if getattr(current, "_xavier_seeding", False):
        return True  # already wrapped in this process: the newest seed applies
    original = current

    def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
        global _pending, _applied_fn
        from vllm.v1.core import kv_cache_utils

        original(hash_fn)
        core.init_none_hash = original  # one call
        seed_now, _pending = _pending, None
        if seed_now is not None:
            kv_cache_utils.NONE_HASH = kv_cache_utils.BlockHash(hash_fn(seed_now))
            _applied_fn = hash_fn

    init_none_hash._xavier_seeding = True  # type: ignore[attr-defined]
    core.init_none_hash = init_none_hash
    return True


def seeded_with(seed: str) -> bool:
    """Whether vLLM's ``NONE_HASH`` in this process is the one ``seed`` gives."""
    from vllm.v1.core import kv_cache_utils

    if _applied_fn is None:
        return False
    current = getattr(kv_cache_utils, "NONE_HASH", None)
    return current is not None and bytes(current) == bytes(_applied_fn(seed))
