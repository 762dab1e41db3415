"""Grouping vLLM's layer tensors per KV-cache group, with each group's block dimension."""

import pytest
import torch

from xinference.model.llm.vllm.xavier.vllm_side.kv_caches import KVHandleError, group_layers


def engine_like_caches(num_blocks: int = 12):
    """One buffer, per-layer views, as vLLM's CPU runner lays them out."""
    buf = torch.zeros(3 * num_blocks * 2 * 16 * 8, dtype=torch.bfloat16)
    layers = buf.view(3, num_blocks, 2, 16, 8)
    return buf, {f"model.layers.{i}.attn": layers[i] for i in range(3)}


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
