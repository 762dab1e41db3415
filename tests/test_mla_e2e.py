"""An MLA model end to end (issue #18): two real vLLM engines with Xavier serve a tiny
DeepSeek-V2-shaped model (multi-head latent attention: per layer one latent cache
``[blocks, tokens, 512 + 64]``, no K/V split).  A cross-replica hit gives the tokens of the
run without sharing, in one load call, every loaded block holding the source's bytes; the
negative control (copy skipped) changes the tokens; a failed block is recomputed.

GPU only: vLLM's CPU platform has no MLA ("MLA is not supported on CPU").  On the H200 the
engines use vLLM's TRITON_MLA decode kernels and FlashAttention-3 for MLA prefill (the only
MLA prefill vLLM offers on Hopper; ``scripts/gpu-dataplane.sh mla`` adds it to the bundle).
The caches' bytes through export, demotion and load are also checked without vLLM, on CPU:
``test_storage_writer.py::test_mla_latent_caches_export_demote_and_load_bit_exact``.
"""

from typing import Tuple

import pytest

from .support.loop_thread import LoopThread
from .support.scenarios import (
    assert_loaded_bytes_exact,
    cross_replica_hit,
    leases,
    negative_control,
    primed,
    serve_with_one_failed_block,
)
from .support.worlds import DEVICE, World, assert_cuda_graphs_unless_eager
from .support.xavier_replicas import Replicas

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    DEVICE != "cuda", reason="vLLM's CPU platform has no MLA attention (GPU only)")]
PREFIX = 512


@pytest.fixture
def world(mla_pair: World) -> Tuple[LoopThread, Replicas]:
    return mla_pair.pair


def block_size(lt, r) -> int:
    return lt.run(r.replicas[0].engine_settings())["block_size"]


def test_vllm_runs_the_model_with_mla_and_xavier_shares_its_latent_cache(world):
    lt, r = world
    settings = lt.run(r.replicas[0].engine_settings())
    print(f"\nMLA engine: {settings}")
    assert settings["use_mla"] is True
    assert_cuda_graphs_unless_eager(settings)
    assert lt.run(r.replicas[0].hook("engine_groups")) == [0]
    assert PREFIX % settings["block_size"] == 0


def test_a_cross_replica_hit_on_an_mla_model_gives_baseline_tokens(world):
    lt, r = world
    blocks = PREFIX // block_size(lt, r)
    hit = cross_replica_hit(lt, r, seed=61, prefix=PREFIX)
    c = hit.counters
    print("\nMLA hit:", {k: c[k] for k in ("hit_blocks", "blocks_written", "batch_calls")})
    assert c["hit_blocks"] == blocks == c["blocks_written"] and c["batch_calls"] == 1
    assert c["load_failures"] == 0 and c["rejected_batches"] == 0
    assert_loaded_bytes_exact(lt, r, blocks)
    assert leases(lt, r) == 0


def test_negative_control_copy_skipped_changes_mla_tokens(world):
    lt, r = world
    negative_control(lt, r, seed=71, prefix=PREFIX)


def test_a_failed_block_on_an_mla_model_is_recomputed(world):
    """vLLM's own recovery (one KV-cache group): the failed block is recomputed."""
    lt, r = world
    s = primed(lt, r, seed=81, prefix=PREFIX)
    ids = serve_with_one_failed_block(lt, r, s.asked, PREFIX // block_size(lt, r))
    assert len(ids) > 0
