import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism.kv_schema import SchemaMismatchError, layout_of


def test_layout_of_and_block_bytes():
    caches = {0: [("l0", torch.empty(10, 2, 16, 8, dtype=torch.bfloat16))],
              1: [torch.empty(2, 7, 16, 8, dtype=torch.float32)]}
    layout = layout_of(caches, {0: 0, 1: 1})
    g0, g1 = layout.group(0), layout.group(1)
    assert g0.layers[0].name == "l0" and g0.num_blocks == 10 and g0.block_bytes == 2 * 16 * 8 * 2
    assert g1.layers[0].block_shape == (2, 16, 8) and g1.num_blocks == 7
    assert g1.block_bytes == 2 * 16 * 8 * 4


def test_fingerprint_ignores_block_counts_and_names():
    a = layout_of({0: [("a", torch.empty(10, 4, dtype=torch.bfloat16))]})
    b = layout_of({0: [("b", torch.empty(99, 4, dtype=torch.bfloat16))]})
    c = layout_of({0: [("a", torch.empty(10, 4, dtype=torch.float16))]})
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    a.check_compatible(b)
    with pytest.raises(SchemaMismatchError, match="layer a: dtype torch.float16"):
        a.check_compatible(c)


def test_bad_block_dim_named():
    with pytest.raises(SchemaMismatchError, match="^block_dim: 3 out of range"):
        layout_of({0: [torch.empty(2, 2)]}, 3)


def test_one_dtype_table_resolves_every_kv_dtype():
    from xinference.model.llm.vllm.xavier.mechanism.kv_schema import (
        KV_DTYPE_BYTES,
        SchemaMismatchError,
        torch_dtype,
    )

    for name, size in KV_DTYPE_BYTES.items():
        dtype = torch_dtype(name)
        assert str(dtype) == name and torch.empty(0, dtype=dtype).element_size() == size
    with pytest.raises(SchemaMismatchError, match="^dtype: unsupported KV dtype torch.complex64"):
        torch_dtype("torch.complex64")


def test_layouts_of_another_tensor_parallel_degree_are_refused_naming_it():
    """A TP=2 worker's shard may have the very shape of a TP=1 replica's cache (a model
    with more KV heads): only the degree tells them apart."""
    from xinference.model.llm.vllm.xavier.mechanism.kv_schema import KVLayout

    base = layout_of({0: [torch.zeros(4, 2, 16, 8)]})
    two = KVLayout(base.groups, tp_size=2)
    assert two.fingerprint() != base.fingerprint()
    two.check_compatible(KVLayout(base.groups, tp_size=2))
    with pytest.raises(SchemaMismatchError,
                       match="tensor_parallel_size 1 does not match local 2"):
        two.check_compatible(base)
    assert layout_of({0: [torch.zeros(4, 2, 16, 8)]}, tp_size=2) == two
