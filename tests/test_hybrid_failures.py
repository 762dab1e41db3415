"""vLLM's recompute of failed loads on engines with several KV-cache groups
(:mod:`xinference.model.llm.vllm.xavier.vllm_side.hybrid_failures`), run on vLLM's own
``Scheduler._update_requests_with_invalid_blocks`` with a stand-in scheduler state (the
method reads only the request, ``block_size`` and the manager's ``get_block_ids``).  The
engine end to end: ``test_hybrid_e2e.py``."""

from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from xinference.model.llm.vllm.xavier.vllm_side import hybrid_failures
from xinference.model.llm.vllm.xavier.vllm_side.hybrid_failures import (
    group_aware,
    install,
    windowed,
)

BS = 16
NULL = 0


class Manager:
    """The parts of vLLM's KVCacheManager the recompute reads."""

    def __init__(self, blocks: Dict[str, List[List[int]]]) -> None:
        self.blocks = blocks
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[None] * len(
            next(iter(blocks.values()))))
        self.block_pool = SimpleNamespace(null_block=SimpleNamespace(block_id=NULL))

    def get_block_ids(self, request_id: str):
        return tuple(self.blocks[request_id])


def scheduler(blocks: Dict[str, List[List[int]]]) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_manager=Manager(blocks), block_size=BS)


def request(rid: str, computed_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed_blocks * BS)


#: a hybrid request of 6 blocks: group 0 full attention, group 1 sliding window (the
#: first three positions outside the window: vLLM's null block)
HYBRID = {"r": [[11, 12, 13, 14, 15, 16], [NULL, NULL, NULL, 24, 25, 26]]}


def test_vllms_own_recompute_fails_on_a_hybrid_request_without_xavier():
    """The negative control: vLLM's method as shipped raises on two groups (the engine
    core dies), which is why Xavier installs the group-aware view."""
    with pytest.raises(ValueError, match="too many values to unpack"):
        unwrapped()(scheduler(HYBRID), [request("r", 6)], {25}, {}, False)


def unwrapped():
    original = Scheduler._update_requests_with_invalid_blocks
    return original.__wrapped__ if getattr(original, hybrid_failures._MARK, False) else original


@pytest.mark.parametrize("failed", [{25}, {14}, {12, 25}, {16}])
def test_a_failed_block_of_any_group_makes_the_request_recompute_in_full(failed):
    """Truncating at the failed position would leave the sliding-window group without
    the window before it (null blocks): the request goes back to zero computed tokens."""
    state = scheduler(HYBRID)
    req = request("r", 6)
    affected, tokens, evict = group_aware(unwrapped())(state, [req], failed, {}, True)
    assert affected == {"r"} and req.num_computed_tokens == 0 and tokens == 6 * BS
    # every group's blocks leave the prefix cache under vLLM's fail policy, never the null one
    assert evict == {b for ids in HYBRID["r"] for b in ids} - {NULL}
    # an asynchronous load's request (evict_blocks=False): nothing evicted
    req = request("r", 6)
    assert group_aware(unwrapped())(scheduler(HYBRID), [req], failed, {}, False) == (
        {"r"}, 6 * BS, set())


def test_untouched_without_failed_blocks_and_vllms_own_method_for_one_group():
    """Only blocks that may hold loaded KV count (the computed ones, minus the tokens of
    this step); the null block never; one group: vLLM's truncation at the failed block."""
    req = request("r", 6)
    wrapped = group_aware(unwrapped())
    assert wrapped(scheduler(HYBRID), [req], {99, NULL}, {}, True) == (set(), 0, set())
    req = request("r", 6)
    assert wrapped(scheduler(HYBRID), [req], {16}, {"r": 2 * BS}, True)[0] == set()
    assert req.num_computed_tokens == 6 * BS
    single = {"s": [[31, 32, 33]]}
    req = request("s", 3)
    affected, _, _ = wrapped(scheduler(single), [req], {32}, {}, True)
    assert affected == {"s"} and req.num_computed_tokens == BS


#: one sliding-window group (every layer windowed): null blocks before the window
WINDOWED = {"w": [[NULL, NULL, 43, 44, 45]]}


def test_one_windowed_group_recomputes_in_full_where_vllm_truncates_into_null_blocks():
    """vLLM's own method truncates at the failed block, so the recompute of position 3
    would attend over null blocks (the window before it was never loaded): the negative
    control.  Xavier's view recomputes the request in full."""
    req = request("w", 5)
    affected, _, _ = unwrapped()(scheduler(WINDOWED), [req], {44}, {}, False)
    assert affected == {"w"} and req.num_computed_tokens == 3 * BS  # into the null blocks
    req = request("w", 5)
    assert group_aware(unwrapped())(scheduler(WINDOWED), [req], {44}, {}, False) == (
        {"w"}, 5 * BS, set())
    assert req.num_computed_tokens == 0


def test_windowed_groups_are_told_from_vllms_specs():

    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8,
                               dtype=torch.float16, sliding_window=64)
    group = lambda spec: SimpleNamespace(layer_names=["l"], kv_cache_spec=spec)  # noqa: E731
    assert not windowed([group(full)]) and not windowed([])
    assert windowed([group(window)]) and windowed([group(full), group(window)])
    # layers of one type whose shapes differ: vLLM groups them under one spec of specs
    uniform = lambda *s: UniformTypeKVCacheSpecs(  # noqa: E731
        block_size=BS, kv_cache_specs={f"l{i}": x for i, x in enumerate(s)})
    wider = SlidingWindowSpec(block_size=BS, num_kv_heads=4, head_size=8,
                              dtype=torch.float16, sliding_window=64)
    assert windowed([group(uniform(window, wider))]) and not windowed([group(uniform(full))])


def test_install_wraps_vllms_scheduler_once_and_leaves_a_fixed_vllm_alone():
    class Shipped:
        def _update_requests_with_invalid_blocks(self, requests, invalid_block_ids,
                                                 num_scheduled_tokens, evict_blocks=True):
            for req_id in requests:
                (req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)
            return set(), 0, set()

    class Fixed:
        def _update_requests_with_invalid_blocks(self, requests, invalid_block_ids,
                                                 num_scheduled_tokens, evict_blocks=True):
            return set(), 0, set()

    shipped = Shipped._update_requests_with_invalid_blocks
    assert install(Shipped) is None
    wrapped = Shipped._update_requests_with_invalid_blocks
    assert wrapped is not shipped and wrapped.__wrapped__ is shipped
    assert install(Shipped) is None and Shipped._update_requests_with_invalid_blocks is wrapped
    fixed = Fixed._update_requests_with_invalid_blocks
    assert install(Fixed) is None and Fixed._update_requests_with_invalid_blocks is fixed
    assert "no _update_requests_with_invalid_blocks" in install(type("Other", (), {}))
    # vLLM's own class (0.26 and 0.27 both still read one list): wrapped
    assert install() is None
    assert getattr(Scheduler._update_requests_with_invalid_blocks, hybrid_failures._MARK)
