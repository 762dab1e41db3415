"""Where vLLM hands blocks out, on vLLM's own ``BlockPool`` (``vllm_side/pool_watch.py``)."""

from __future__ import annotations

from typing import List

import numpy as np
from vllm.v1.core.block_pool import BlockPool

from xinference.model.llm.vllm.xavier.planning.in_place import InPlaceBook
from xinference.model.llm.vllm.xavier.planning.shards import Shards
from xinference.model.llm.vllm.xavier.vllm_side.pool_watch import watch_block_pool


def test_blocks_are_bumped_before_vllm_sees_them_and_a_reset_bumps_all():
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    gens = np.zeros(6, np.int64)
    book = InPlaceBook([gens], Shards(1))
    seen: List[List[int]] = []
    resets: List[bool] = []

    def handed_out(ids):
        seen.append(list(ids))
        book.handed_out(ids)

    assert watch_block_pool(pool, handed_out, lambda: resets.append(True))
    assert not watch_block_pool(pool, handed_out, lambda: None)  # once
    blocks = pool.get_new_blocks(2)
    ids = [b.block_id for b in blocks]
    assert seen == [ids] and all(gens[i] == 1 for i in ids)
    # while blocks are in use vLLM refuses the reset: nothing bumped
    assert not pool.reset_prefix_cache() and resets == []
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(5)  # every free block, the two freed ones included
    assert {b.block_id for b in again} >= set(ids)
    assert all(gens[i] == 2 for i in ids)
    pool.free_blocks(again)
    assert pool.reset_prefix_cache() and resets == [True]


def test_a_pool_without_the_methods_is_left_alone():
    class Pool:
        pass

    assert not watch_block_pool(Pool(), lambda ids: None, lambda: None)
