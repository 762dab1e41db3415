"""A hybrid model end to end: vLLM's hybrid KV-cache manager stays on with Xavier.

Two real vLLM engines with Xavier serve a tiny Gemma-3-shaped model whose layers alternate
sliding-window (48 tokens) and full attention: two KV-cache groups, and in the
sliding-window group vLLM's null block for every block outside the window.  Checked as a
user would: vLLM keeps its hybrid manager (no "Turning off hybrid kv cache manager"), the
KV cache holds as many blocks as plain vLLM's for this model, a cross-replica hit gives the
tokens of the run without sharing, every loaded block holds the source's bytes, the null
blocks of the loads were skipped (counted), and a failed load is recomputed without taking
the engine down (vLLM's own recompute raises on two groups: ``test_hybrid_failures.py``).
The world is the shared ``hybrid_pair`` (on the GPU machine, ``scripts/gpu-dataplane.sh
hybrid``, both replicas on one GPU); baselines and scenarios are those of
``tests/support/scenarios.py``.
"""

from typing import Tuple

import pytest

from .support.engines import EngineOptions, EngineProcess
from .support.loop_thread import LoopThread
from .support.processes import tokens
from .support.scenarios import (
    assert_loaded_bytes_exact,
    cross_replica_hit,
    delta,
    leases,
    negative_control,
    primed,
)
from .support.worlds import DEVICE, World, assert_cuda_graphs_unless_eager
from .support.xavier_replicas import Replicas

pytestmark = pytest.mark.slow

PREFIX = 512  # tokens: 32 blocks of 16; the window is 3 blocks
BLOCK = 16
GROUPS = 2


@pytest.fixture
def world(hybrid_pair: World) -> Tuple[LoopThread, Replicas]:
    return hybrid_pair.pair


def test_vllm_keeps_its_hybrid_kv_cache_manager_with_xavier(world, tiny_hybrid_model_dir):
    """The KV cache is sized as plain vLLM sizes it for this model (one engine without a
    KV connector, the same KV space): with the hybrid manager turned off, the
    sliding-window layers would take a full-attention share each and fewer blocks fit."""
    lt, r = world
    settings = lt.run(r.replicas[0].engine_settings())
    assert settings["hybrid_kv_cache_manager"] is True
    assert lt.run(r.replicas[0].hook("engine_groups")) == list(range(GROUPS))
    if DEVICE == "cuda":  # the GPU's KV cache is sized from free memory: no fixed comparison
        print(f"\nhybrid engine with Xavier: {settings}")
        assert_cuda_graphs_unless_eager(settings)
        return
    # vLLM's engine core in the child's own process (one process to start, not three):
    # the KV cache is sized from the same KV space and the same model either way
    plain = EngineProcess(EngineOptions(model=tiny_hybrid_model_dir),
                          env={"XAVIER_TEST_HOOKS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        plain_settings = plain.request({"op": "settings"})
    finally:
        plain.close()
    print(f"\nXavier: {settings}\nplain vLLM: {plain_settings}")
    assert plain_settings["hybrid_kv_cache_manager"] is True
    assert settings["num_gpu_blocks"] == plain_settings["num_gpu_blocks"] > 0


def test_a_cross_replica_hit_on_a_hybrid_model_gives_baseline_tokens(world):
    lt, r = world
    a, b = r.replicas
    hit = cross_replica_hit(lt, r, seed=31, prefix=PREFIX)
    out, c = hit.out, hit.counters
    print("\nhybrid hit:", {k: c[k] for k in ("hit_blocks", "blocks_written",
                                              "null_blocks_skipped")})
    if DEVICE == "cpu":  # CPU kernels: also equal to computing the whole prompt
        lt.run(a.reset_prefix_cache())
        assert out["ids"] == lt.run(a.generate([hit.scenario.asked], xavier=False))[0]["ids"]
    assert c["hit_blocks"] == PREFIX // BLOCK and c["batch_calls"] == 1
    # every position of every group was either loaded or vLLM's null block (skipped): the
    # sliding-window group keeps only the blocks of the window, so most of its were null
    assert c["blocks_written"] + c["null_blocks_skipped"] == GROUPS * PREFIX // BLOCK
    assert PREFIX // BLOCK - 4 <= c["null_blocks_skipped"] < PREFIX // BLOCK
    assert c["load_failures"] == 0 and c["rejected_batches"] == 0
    # both groups read in place from A's vLLM cache (one block-id space: one generation row)
    assert c["rows_from_vllm_cache"] == c["blocks_written"] == c["reads_validated"]
    assert_loaded_bytes_exact(lt, r, c["blocks_written"])
    assert leases(lt, r) == 0


def test_negative_control_copy_skipped_changes_hybrid_tokens(world):
    lt, r = world
    negative_control(lt, r, seed=41, prefix=PREFIX)


def test_a_failed_load_on_a_hybrid_model_is_recomputed_and_the_engine_serves_on(world):
    """vLLM's own recompute of a failed load raises on two KV-cache groups (the engine core
    would die); with Xavier the request recomputes in full: the baseline's tokens, and the
    engine serves the next request."""
    lt, r = world
    a, b = r.replicas
    s = primed(lt, r, seed=51, prefix=PREFIX)
    before = lt.run(b.counters())
    lt.run(b.inject_fault("fail_one_block"))
    out = lt.run(b.generate([s.asked]))
    c = delta(before, lt.run(b.counters()))
    assert c["faults_fail_one_block"] == 1 and c["hit_blocks"] == PREFIX // BLOCK
    if DEVICE == "cpu":  # on the GPU a recompute in another shape may change low bits
        assert out[0]["ids"] == s.base
    assert out[0]["cached"] < PREFIX  # recomputed, not served from the failed load
    assert lt.run(b.stored_vs_engine_mismatches()) == []
    assert leases(lt, r) == 0
    nxt = tokens(54, 100)
    served = lt.run(b.generate([nxt]))[0]["ids"]
    assert len(served) == 16
    if DEVICE == "cpu":
        assert served == lt.run(a.generate([nxt], xavier=False))[0]["ids"]
