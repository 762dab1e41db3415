"""A worker's vLLM cache as other processes read it in place (``mechanism/in_place.py``)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism.in_place import (
    InPlaceSource,
    describe_caches,
    open_caches,
    share_host_caches,
)
from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier


def _vllm_like_caches():
    """Two layers viewing one raw int8 buffer (as vLLM's reshaped caches do), one more
    view object over the first layer, random bits."""
    raw = torch.randint(-128, 127, (2 * 6 * 2 * 4 * 8 * 2,), dtype=torch.int8)
    half = raw.numel() // 2
    a = raw[:half].view(torch.bfloat16).view(6, 2, 4, 8)
    b = raw[half:].view(torch.bfloat16).view(6, 2, 4, 8)
    alias = raw[:half].view(torch.bfloat16).view(6, 2, 4, 8)
    return a, b, alias


def _peer_reads(handles, block, q):
    caches, release = open_caches(handles)
    q.put([caches[0][i][block].view(torch.int16).tolist() for i in range(2)])
    release()


def test_the_cache_moves_into_shared_memory_in_place_and_a_peer_process_reads_it():
    a, b, alias = _vllm_like_caches()
    before = [a.clone(), b.clone()]
    shared = share_host_caches({0: [a, b]}, others=[alias])
    gens = SlotGenerations.create_shared(int(Tier.VLLM), [0], 6)
    try:
        assert len(shared.files) == 1  # one storage, one file: the layers still share it
        bits = [x.view(torch.int16) for x in (a, b, *before)]  # random bits: NaNs too
        assert torch.equal(bits[0], bits[2]) and torch.equal(bits[1], bits[3])
        assert alias.data_ptr() == a.data_ptr()  # every view object was moved
        a[3].fill_(1.5)  # vLLM writes through the tensors it holds ...
        handles = describe_caches({0: [a, b]}, {0: 0}, gens, 6, shared)
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_peer_reads, args=(handles, 3, q))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        # ... and another process sees those bytes
        assert got == [a[3].view(torch.int16).tolist(), b[3].view(torch.int16).tolist()]
    finally:
        gens.close()
        shared.close()
    assert not any(os.path.exists(f) for f in shared.files)


def test_the_actor_serves_rows_and_reads_the_generations_after_its_gather():
    a, b, _ = _vllm_like_caches()
    shared = share_host_caches({0: [a, b]})
    gens = SlotGenerations.create_shared(int(Tier.VLLM), [0], 6)
    gens.row(int(Tier.VLLM), 0)[[1, 4]] = [7, 9]
    source = InPlaceSource(describe_caches({0: [a, b]}, {0: 0}, gens, 6, shared))
    try:
        rows = source.gather_rows(Tier.VLLM, 0, [4, 1])
        assert [r.shape for r in rows] == [(2, 2 * 4 * 8 * 2)] * 2
        assert torch.equal(rows[0][0], a[4].contiguous().view(torch.uint8).flatten())
        assert source.generations.row(int(Tier.VLLM), 0)[[4, 1]].tolist() == [9, 7]
        with pytest.raises(ValueError, match="^tier:"):
            source.gather_rows(Tier.GPU, 0, [1])
    finally:
        source.close()
        gens.close()
        shared.close()


def test_a_device_cache_is_not_moved():
    meta = torch.empty(2, 2, device="meta")
    with pytest.raises(ValueError, match="^KV cache: a meta tensor"):
        share_host_caches({0: [meta]})
