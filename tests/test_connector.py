"""The connector's front (:mod:`xinference.model.llm.vllm.xavier.vllm_side.connector`): what
vLLM checks of the class, and which KV caches it shares (on vLLM's own spec classes).  The
connector on real engines: ``test_connector_e2e.py`` and ``test_hybrid_e2e.py``."""

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from xinference.model.llm.vllm.xavier.vllm_side.connector import XavierConnector, sharing_problem

BS = 16


def full(block_size: int = BS) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(["full.0"], FullAttentionSpec(
        block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))


def sliding() -> KVCacheGroupSpec:
    return KVCacheGroupSpec(["sw.0"], SlidingWindowSpec(
        BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=48))


def test_vllm_sees_the_connector_as_supporting_its_hybrid_kv_cache_manager():
    """vLLM turns its hybrid manager off for a connector without ``SupportsHMA``
    (``VllmConfig``: "Turning off hybrid kv cache manager ...")."""
    assert supports_hma(XavierConnector)


def test_attention_groups_of_one_block_size_are_shared():
    assert sharing_problem([full()], BS) is None
    assert sharing_problem([full(), sliding()], BS) is None
    assert sharing_problem([], BS) is None


def test_other_caches_turn_sharing_off_with_a_message_naming_the_group():
    mamba = KVCacheGroupSpec(["ssm.1"], MambaSpec(BS, shapes=((4, 8),), dtypes=(torch.float32,)))
    why = sharing_problem([full(), mamba], BS)
    assert why is not None and "KV-cache group 1 holds MambaSpec layers" in why
    cross = KVCacheGroupSpec(["x.0"], CrossAttentionSpec(
        BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))
    why = sharing_problem([cross], BS)
    assert why is not None and "group 0 holds CrossAttentionSpec" in why
    why = sharing_problem([full(), full(64)], BS)
    assert why is not None and "block sizes [16, 64]" in why


def test_tensor_parallel_replicas_share_pipeline_parallel_ones_do_not():
    """Each worker of a tensor-parallel replica stores and loads its own shard of the KV
    heads (issue #22); a pipeline stage holds only some layers: not shared."""
    assert sharing_problem([full()], BS, tensor_parallel=2) is None
    why = sharing_problem([full()], BS, tensor_parallel=2, pipeline_parallel=2)
    assert why is not None and why.startswith("pipeline_parallel_size=2")
    assert sharing_problem([full()], BS, 1, 1) is None


def test_blocks_named_by_a_non_cryptographic_prefix_hash_are_not_shared():
    """Block names cross replicas (and tenants): vLLM's xxhash prefix hashes would let a
    crafted prompt collide with another's blocks; sha256 (vLLM's default) is shared."""
    for algo in (None, "sha256", "sha256_cbor"):
        assert sharing_problem([full()], BS, hash_algo=algo) is None
    why = sharing_problem([full()], BS, hash_algo="xxhash")
    assert why is not None and why.startswith("prefix_caching_hash_algo: ")
    assert "got 'xxhash'" in why
