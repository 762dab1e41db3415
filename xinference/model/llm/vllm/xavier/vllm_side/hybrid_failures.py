"""vLLM's recompute of failed loads, for engines with several KV-cache groups.

vLLM 0.26 and 0.27 recompute a request whose external load failed in
``Scheduler._update_requests_with_invalid_blocks``, which takes the request's blocks as ONE
list (``(req_block_ids,) = kv_cache_manager.get_block_ids(req_id)``, marked "TODO: add
support for hybrid memory allocator").  With the hybrid KV-cache manager a request has a
list per group, so the first failed load reported on a hybrid model (sliding-window +
full attention) raises ``ValueError`` in the engine core and takes every request of the
engine down (vllm-project/vllm#45474).

Truncating at the first failed block, as vLLM does for one group, would be wrong here:
the sliding-window group holds vLLM's null block for every position outside the window
of the request's END, so the window before an earlier position was never loaded (nor
kept from the local hit).  :func:`group_aware` therefore does what vLLM's later fix does
(vllm-project/vllm#50388, "affected hybrid requests recompute in full"): a request with
a failed block in any group goes back to zero computed tokens.  Xavier's loads are
asynchronous, so such a request is still waiting for its load: vLLM frees its blocks and
schedules it again from its local prefix-cache hit (Xavier offers it no second load).
Engines with one group keep vLLM's own method -- unless that group is windowed (every
layer sliding-window or chunked-local): the same null blocks, the same full recompute
(:func:`windowed`; found by a second read in session 30).

:func:`install` (the scheduler half calls it when the engine has several groups or a
windowed one) puts
it in place where vLLM's method still reads one list (checked in its source); where it
cannot, it says why and the connector turns sharing off for the engine (never a load
whose failure would kill the engine).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Iterable, Optional, Set, Tuple

from ..planning.log_names import package_logger

logger = package_logger(__name__)

#: vLLM's scheduler method that recomputes failed loads
METHOD = "_update_requests_with_invalid_blocks"
#: the line of vLLM's method that assumes one KV-cache group
SINGLE_GROUP_LINE = "(req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)"
_MARK = "_xavier_group_aware"


def group_aware(original: Any) -> Any:
    """vLLM's ``_update_requests_with_invalid_blocks`` for engines with several KV-cache
    groups, or one windowed group: a request with a failed block in any group recomputes in
    full (see the module docstring); one group and no null block among the requests' (full
    attention, or a window that covers them): vLLM's own method."""

    @functools.wraps(original)
    def update(self: Any, requests: Iterable[Any], invalid_block_ids: Set[int],
               num_scheduled_tokens: Dict[str, int], evict_blocks: bool = True
               ) -> Tuple[Set[str], int, Set[int]]:
        manager = self.kv_cache_manager
        null = null_block_id(manager)
        requests = list(requests)
        if len(manager.kv_cache_config.kv_cache_groups) <= 1 and not any(
                null in ids for r in requests for ids in manager.get_block_ids(r.request_id)):
            return original(self, requests, invalid_block_ids, num_scheduled_tokens,
                            evict_blocks)
        affected: Set[str] = set()
        tokens = 0
        evict: Set[int] = set()
        for request in requests:
            rid = request.request_id
            computed = request.num_computed_tokens - num_scheduled_tokens.get(rid, 0)
            positions = -(-computed // self.block_size)  # blocks that may hold loaded KV
            groups = manager.get_block_ids(rid)
            if not any(b in invalid_block_ids and b != null
                       for ids in groups for b in ids[:positions]):
                continue
            affected.add(rid)
            tokens += computed
            request.num_computed_tokens = 0
            if evict_blocks:
                evict.update(b for ids in groups for b in ids if b != null)
        return affected, tokens, evict

    setattr(update, _MARK, True)
    return update


def windowed(groups: Iterable[Any]) -> bool:
    """Whether a KV-cache group (vLLM's ``KVCacheGroupSpec``) attends within a window
    (sliding-window or chunked-local): its requests hold null blocks outside it.  A group
    whose layers differ in shape only (vLLM's ``UniformTypeKVCacheSpecs``) is windowed when
    its layers are."""
    def specs(spec: Any) -> Iterable[Any]:
        inner = getattr(spec, "kv_cache_specs", None)
        return inner.values() if isinstance(inner, dict) else (spec,)

    return any(getattr(spec, name, None)
               for g in groups for spec in specs(getattr(g, "kv_cache_spec", None))
               for name in ("sliding_window", "attention_chunk_size"))


def null_block_id(manager: Any) -> Optional[int]:
    """The id of vLLM's null block (the placeholder of skipped sliding-window blocks)."""
    block = getattr(getattr(manager, "block_pool", None), "null_block", None)
    return None if block is None else int(block.block_id)


def install(scheduler_cls: Optional[type] = None) -> Optional[str]:
    """Make vLLM's scheduler recompute failed loads of multi-group engines (once per
    process); returns None when in place (or when vLLM needs nothing), else why not."""
    if scheduler_cls is None:
        try:
            from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
        except ImportError as exc:  # pragma: no cover - vLLM moved it
            return f"vLLM's scheduler could not be imported ({exc})"
    method = getattr(scheduler_cls, METHOD, None)
    if method is None:
        return ("vLLM's scheduler has no _update_requests_with_invalid_blocks: its "
                "recompute of failed loads is not known for hybrid KV caches")
    if getattr(method, _MARK, False):
        return None
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError) as exc:
        return f"the source of vLLM's recompute of failed loads is not readable ({exc})"
    if SINGLE_GROUP_LINE not in source:
        return None  # it no longer reads a request's blocks as one list: nothing to do
    setattr(scheduler_cls, METHOD, group_aware(method))
    logger.info("xavier: vLLM's recompute of failed loads reads every KV-cache group "
                "(vllm-project/vllm#45474)")
    return None
