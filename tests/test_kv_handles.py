"""Sharing an engine's KV caches with the transfer actor's process (CPU: in place, into
shared memory; CUDA: IPC), and grouping vLLM's layer tensors."""

import multiprocessing as mp

import pytest
import torch

from xinference.model.llm.vllm.xavier.kv_handles import (
    KVHandleError,
    group_layers,
    open_handles,
    share,
)


def engine_like_caches(num_blocks: int = 12):
    """One buffer, per-layer views, as vLLM's CPU runner lays them out."""
    buf = torch.zeros(3 * num_blocks * 2 * 16 * 8, dtype=torch.bfloat16)
    layers = buf.view(3, num_blocks, 2, 16, 8)
    return buf, {f"model.layers.{i}.attn": layers[i] for i in range(3)}


def _child_write(handles, value) -> None:
    caches = open_handles(handles)
    for _, t in caches[0]:
        t[5].fill_(value)


def test_cpu_caches_move_to_shared_memory_in_place_and_another_process_writes_them():
    buf, kv = engine_like_caches()
    gen = torch.Generator().manual_seed(0)
    buf.copy_(torch.randn(buf.shape, generator=gen).to(torch.bfloat16))
    before = buf.clone()
    groups, dims = group_layers(kv, [list(kv)], num_blocks=12)
    handles = share(groups, dims)
    assert torch.equal(buf, before)  # contents kept by the move
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_write, args=(handles, 3.0))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    for name, t in kv.items():  # the engine's own views see the child's writes ...
        assert bool((t[5] == 3.0).all()), name
        assert torch.equal(t[4], before.view(3, 12, 2, 16, 8)[int(name.split(".")[2])][4])


def test_group_layers_dedupes_shared_tensors_and_finds_the_block_dim():
    _, kv = engine_like_caches()
    kv["model.layers.3.attn"] = kv["model.layers.0.attn"]  # KV sharing between layers
    groups, dims = group_layers(kv, [list(kv)], num_blocks=12)
    assert [n for n, _ in groups[0]] == [f"model.layers.{i}.attn" for i in range(3)]
    assert dims == {0: 0}
    flash_like = {"l0": torch.zeros(2, 12, 16, 2, 8)}  # (2, num_blocks, ...) layouts
    assert group_layers(flash_like, [["l0"]], 12)[1] == {0: 1}


def test_unusable_caches_are_refused_with_the_layer_named():
    with pytest.raises(KVHandleError, match="l0: no dimension of size num_blocks=12"):
        group_layers({"l0": torch.zeros(24, 16, 8)}, [["l0"]], 12)
    with pytest.raises(KVHandleError, match="no layer"):
        group_layers({}, [["l0"]], 12)
    with pytest.raises(KVHandleError, match="layer l0: KV cache is list"):
        group_layers({"l0": [torch.zeros(12, 4)]}, [["l0"]], 12)  # type: ignore[dict-item]
