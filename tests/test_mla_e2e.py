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

import os
from typing import Iterator

import pytest

from .support.engines import EngineOptions
from .support.processes import tokens
from .support.xavier_replicas import replicas_in_loop_thread
from .test_connector_e2e import (
    assert_loaded_bytes_exact,
    baseline_then_prime,
    delta,
    serve_with_one_failed_block,
)

DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    DEVICE != "cuda", reason="vLLM's CPU platform has no MLA attention (GPU only)")]
PREFIX = 512


@pytest.fixture(scope="module")
def world(tiny_mla_model_dir: str) -> Iterator[tuple]:
    opts = EngineOptions(model=tiny_mla_model_dir, extra={
        "attention_backend": "TRITON_MLA", "gpu_memory_utilization": 0.25})
    yield from replicas_in_loop_thread(tiny_mla_model_dir, n=2, gpu_budget="256MiB",
                                       cpu_budget="64MiB", engine=opts, sequential=True)


def block_size(lt, r) -> int:
    return lt.run(r.replicas[0].engine_settings())["block_size"]


def test_vllm_runs_the_model_with_mla_and_xavier_shares_its_latent_cache(world):
    lt, r = world
    settings = lt.run(r.replicas[0].engine_settings())
    print(f"\nMLA engine: {settings}")
    assert settings["use_mla"] is True
    assert lt.run(r.replicas[0].hook("engine_groups")) == [0]
    assert PREFIX % settings["block_size"] == 0


def test_a_cross_replica_hit_on_an_mla_model_gives_baseline_tokens(world):
    lt, r = world
    a, b = r.replicas
    blocks = PREFIX // block_size(lt, r)
    shared = tokens(61, PREFIX)
    asked = shared + tokens(63, 40)
    base = baseline_then_prime(lt, r, [asked], [shared + tokens(62, 40)], local_hit=PREFIX)
    before = lt.run(b.counters())
    out = lt.run(b.generate([asked]))
    c = delta(before, lt.run(b.counters()))
    print("\nMLA hit:", {k: c[k] for k in ("hit_blocks", "blocks_written", "batch_calls")})
    assert out[0]["ids"] == base[0]
    assert out[0]["cached"] == PREFIX
    assert c["hit_blocks"] == blocks == c["blocks_written"] and c["batch_calls"] == 1
    assert c["load_failures"] == 0 and c["rejected_batches"] == 0
    assert_loaded_bytes_exact(lt, r, blocks)
    assert lt.run(r.tracker.stats())["outstanding_leases"] == 0


def test_negative_control_copy_skipped_changes_mla_tokens(world):
    lt, r = world
    a, b = r.replicas
    shared = tokens(71, PREFIX)
    asked = shared + tokens(73, 40)
    base = baseline_then_prime(lt, r, [asked], [shared + tokens(72, 40)], local_hit=PREFIX)
    lt.run(b.inject_fault("skip_copy"))
    out = lt.run(b.generate([asked]))
    assert out[0]["cached"] == PREFIX and out[0]["ids"] != base[0]
    assert lt.run(r.tracker.stats())["outstanding_leases"] == 0


def test_a_failed_block_on_an_mla_model_is_recomputed(world):
    """vLLM's own recovery (one KV-cache group): the failed block is recomputed."""
    lt, r = world
    shared = tokens(81, PREFIX)
    asked = shared + tokens(83, 40)
    baseline_then_prime(lt, r, [asked], [shared + tokens(82, 40)], local_hit=PREFIX)
    ids = serve_with_one_failed_block(lt, r, asked, PREFIX // block_size(lt, r))
    assert len(ids) > 0
