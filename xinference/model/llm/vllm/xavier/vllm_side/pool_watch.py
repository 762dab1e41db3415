"""Where vLLM hands its KV blocks out to be written: the one place the in-place tier's
generations are bumped (engine-core process, scheduler thread).

vLLM binds its block pool to the connector (``KVConnectorBase_V1.bind_gpu_block_pool``,
called once the scheduler's KV-cache manager exists).  Every reuse of a block goes
through ``BlockPool.get_new_blocks`` (new requests, running ones growing, resumed ones,
asynchronous-load destinations, every KV-cache group: one pool); a prefix hit only
``touch``-es a block and writes nothing.  :func:`watch_block_pool` wraps the pool's
``get_new_blocks`` so that the blocks it returns are reported (and their generations
bumped, :meth:`~..planning.in_place.InPlaceBook.handed_out`) before vLLM sees them, and
its ``reset_prefix_cache`` so that a successful reset makes every block a new
generation.  ``get_new_blocks`` runs inside ``schedule()``, before the step that writes
the blocks is launched; a reset runs between steps, when no block is in use
(``doc/validated-reads.md``, "The in-place tier")."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from ..planning.log_names import package_logger

logger = package_logger(__name__)

#: marks a pool already wrapped (a second bind must not bump twice)
_WATCHED = "_xavier_watched"


def watch_block_pool(pool: Any, handed_out: Callable[[Sequence[int]], None],
                     reset: Callable[[], None]) -> bool:
    """Wrap ``pool``'s ``get_new_blocks`` (``handed_out(block ids)`` before the blocks are
    returned) and ``reset_prefix_cache`` (``reset()`` after a reset that succeeded).
    Returns False, and changes nothing, for a pool without them or one already watched."""
    get_new = getattr(pool, "get_new_blocks", None)
    reset_cache = getattr(pool, "reset_prefix_cache", None)
    if get_new is None or reset_cache is None:
        logger.warning("xavier: vLLM's block pool has no get_new_blocks/reset_prefix_cache: "
                       "its cache cannot be read in place")
        return False
    if getattr(pool, _WATCHED, False):
        return False

    def get_new_blocks(num_blocks: int) -> List[Any]:
        blocks: List[Any] = get_new(num_blocks)
        handed_out([b.block_id for b in blocks])
        return blocks

    def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
        done = reset_cache(*args, **kwargs)
        if done:
            reset()
        return done

    pool.get_new_blocks = get_new_blocks
    pool.reset_prefix_cache = reset_prefix_cache
    setattr(pool, _WATCHED, True)
    return True
