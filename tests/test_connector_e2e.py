"""Cross-replica prefix hits end to end: two real vLLM CPU engines with Xavier, each in its
own xoscar sub pool (its engine core a further process), the directory in the test's pool.

Baselines are greedy runs of the same prompt on replica A with sharing turned off for the
request (``kv_transfer_params={"xavier": False}``: no query, no export), after which A's
local prefix cache is reset so that A's next request computes and exports every block.
"""

import os
import random
from typing import Iterator, List

import pytest

from .support.engines import EngineOptions
from .support.loop_thread import LoopThread, enter, leave
from .support.xavier_replicas import Replicas, xavier_replicas

#: "cuda" on the GPU machine: two engines share one GPU, storage GPU tiers, CUDA IPC loads
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")

pytestmark = pytest.mark.slow

PREFIX = 512  # tokens: 32 blocks of 16


def tokens(seed: int, n: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def world(tiny_model_dir: str) -> Iterator[tuple]:
    lt = LoopThread()
    if DEVICE == "cuda":
        opts = EngineOptions(model=tiny_model_dir, extra={
            "attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.25})
        cm = xavier_replicas(tiny_model_dir, n=2, gpu_budget="256MiB", cpu_budget="64MiB",
                             engine=opts)
    else:
        cm = xavier_replicas(tiny_model_dir, n=2)
    replicas = lt.run(enter(cm))
    try:
        yield lt, replicas
    finally:
        lt.run(leave(cm))
        lt.stop()


def baseline_then_prime(lt: LoopThread, r: Replicas, shared: List[int],
                        prime: List[List[int]], asked: List[List[int]]) -> List[List[int]]:
    """Tokens of ``asked`` without sharing (on A); then A serves ``prime`` with sharing."""
    a = r.replicas[0]
    base = lt.run(a.generate(asked, xavier=False))
    lt.run(a.reset_prefix_cache())
    lt.run(a.generate(prime))
    return [x["ids"] for x in base]


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_cross_replica_hit_gives_baseline_tokens_in_one_load_call(world):
    lt, r = world
    a, b = r.replicas
    shared = tokens(1, PREFIX)
    base = baseline_then_prime(lt, r, shared, [shared + tokens(2, 40)], [shared + tokens(3, 40)])
    before = lt.run(b.counters())
    out = lt.run(b.generate([shared + tokens(3, 40)]))
    c = delta(before, lt.run(b.counters()))
    assert out[0]["ids"] == base[0]
    assert out[0]["cached"] == PREFIX  # B had nothing locally: all of it came from A
    assert c["hit_blocks"] == PREFIX // 16 and c["blocks_written"] == PREFIX // 16
    assert c["batch_calls"] == 1 == c["steps_with_loads"]
    assert c["load_failures"] == 0 and c["rejected_batches"] == 0
    # GPU machine: A's GPU tier, read over CUDA IPC; CPU machine: A's shared-memory tier
    tier = "rows_from_gpu_tier" if DEVICE == "cuda" else "rows_from_cpu_tier"
    assert c[tier] == PREFIX // 16
    assert lt.run(r.tracker.stats())["outstanding_leases"] == 0
    metrics = lt.run(b.metrics_text())
    assert 'xavier_blocks_written_total{rank="2"}' in metrics


def test_negative_control_copy_skipped_changes_tokens(world):
    """The same check as above catches a hit whose copy did not happen."""
    lt, r = world
    a, b = r.replicas
    shared = tokens(11, PREFIX)
    base = baseline_then_prime(lt, r, shared, [shared + tokens(12, 40)],
                               [shared + tokens(13, 40)])
    lt.run(b.inject_fault("skip_copy"))
    out = lt.run(b.generate([shared + tokens(13, 40)]))
    assert out[0]["cached"] == PREFIX  # the hit was claimed ...
    assert out[0]["ids"] != base[0]  # ... and the missing copy is caught
    assert lt.run(r.tracker.stats())["outstanding_leases"] == 0


def test_failed_block_is_recomputed_by_vllm(world):
    lt, r = world
    a, b = r.replicas
    shared = tokens(21, PREFIX)
    base = baseline_then_prime(lt, r, shared, [shared + tokens(22, 40)],
                               [shared + tokens(23, 40)])
    before = lt.run(b.counters())
    lt.run(b.inject_fault("fail_one_block"))  # that block is zeroed and reported failed
    out = lt.run(b.generate([shared + tokens(23, 40)]))
    c = delta(before, lt.run(b.counters()))
    assert c["faults_fail_one_block"] == 1
    assert c["blocks_written"] == PREFIX // 16 - 1
    assert out[0]["ids"] == base[0]
    assert lt.run(r.tracker.stats())["outstanding_leases"] == 0


def test_concurrent_requests_share_one_load_call_per_step(world):
    lt, r = world
    a, b = r.replicas
    prefixes = [tokens(100 + i, 256) for i in range(6)]
    asked = [p + tokens(200 + i, 30) for i, p in enumerate(prefixes)]
    base = baseline_then_prime(lt, r, [], [p + tokens(300 + i, 30)
                                           for i, p in enumerate(prefixes)], asked)
    before = lt.run(b.counters())
    out = lt.run(b.generate(asked))
    c = delta(before, lt.run(b.counters()))
    assert [o["ids"] for o in out] == base
    with_hits = sum(1 for o in out if o["cached"] > 0)
    assert with_hits == 6
    assert c["logical_requests"] == with_hits == c["requests_with_hits"]
    assert c["batch_calls"] == c["steps_with_loads"] >= 1
    assert c["batch_calls"] < with_hits  # batched: fewer calls than requests
    assert lt.run(r.tracker.stats())["outstanding_leases"] == 0
