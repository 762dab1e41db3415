"""Tensor-parallel replicas end to end: two TP=2 replicas of the tiny Qwen2 share a prefix.

Each replica is a real vLLM engine with two workers (vLLM's multiprocessing executor; on
this 2-core machine vLLM's CPU build runs them with ``VLLM_CPU_OMP_THREADS_BIND="0|1"``),
each worker holding one of the model's two KV heads.  Checked as a user would: both workers
attached before hits are offered, a cross-replica hit gives the tokens of the run without
sharing with every block loaded on BOTH shards (each worker one load call), every loaded
block of each shard holds the source's bytes of that shard (and the two shards differ:
they are different heads), leases back to zero; one worker's copies skipped change the
tokens (negative control); one worker's failed block makes vLLM
recompute the block on both (tokens equal the baseline, nothing stored from the failed
step).  The planning side (directory groups, rows and leases per worker) is tested in
``test_shards.py``.

``XAVIER_TEST_DEVICE=cuda`` (``scripts/gpu-dataplane.sh tp`` on ``nvidia-h200-x2``): each
replica on both GPUs.
"""

from typing import Tuple

import pytest

from .support.loop_thread import LoopThread
from .support.scenarios import cross_replica_hit, delta, leases, negative_control, primed
from .support.worlds import DEVICE, TP, World
from .support.xavier_replicas import Replicas

pytestmark = pytest.mark.slow

PREFIX = 256  # tokens: 16 blocks of 16
BLOCK = 16


@pytest.fixture
def world(tp_pair: World) -> Tuple[LoopThread, Replicas]:
    return tp_pair.pair


def test_every_worker_of_a_tp_replica_attaches_with_its_own_shard(world):
    lt, r = world
    for replica in r.replicas:
        assert lt.run(replica.hook_all("tp_rank")) == list(range(TP))
        assert lt.run(replica.transfer_ready())  # both shards registered


def test_a_cross_replica_hit_loads_every_shard_and_gives_baseline_tokens(world):
    lt, r = world
    a, b = r.replicas
    hit = cross_replica_hit(lt, r, seed=61, prefix=PREFIX, tail=30)
    out, c = hit.out, hit.counters
    print("\nTP=2 hit:", {k: c[k] for k in ("hit_blocks", "blocks_written", "batch_calls")})
    if DEVICE == "cpu":  # CPU kernels: also equal to computing the whole prompt
        lt.run(a.reset_prefix_cache())
        assert out["ids"] == lt.run(a.generate([hit.scenario.asked], xavier=False))[0]["ids"]
    blocks = PREFIX // BLOCK
    assert c["hit_blocks"] == blocks  # counted once per replica
    assert c["blocks_written"] == TP * blocks  # every block on every shard
    assert c["batch_calls"] == TP  # ONE load call per worker
    # each worker read its shard straight from A's vLLM cache (its own file of generations)
    assert c["rows_from_vllm_cache"] == TP * blocks == c["reads_validated"]
    assert c["load_failures"] == 0 and c["rejected_batches"] == 0
    loaded = lt.run(b.hook_all("loaded_block_digests"))
    shard_digests = []
    for k in range(TP):
        mine = {(g, int(key)): d for g, key, d in loaded[k]}
        assert len(mine) >= blocks
        stored = lt.run(a.hook_all("stored_block_digests", [[g, str(key)] for g, key in mine]))
        assert {(g, int(key)): d for g, key, d in stored[k]} == mine  # A's shard k, exact
        shard_digests.append(mine)
    common = set(shard_digests[0]) & set(shard_digests[1])
    assert common and all(shard_digests[0][x] != shard_digests[1][x] for x in common)
    assert leases(lt, r) == 0


def test_negative_control_one_shard_not_copied_changes_tokens(world):
    """Worker 1 of B skips its copies (and claims success) while worker 0 loads its shard:
    the tokens differ from the baseline, so the hit test above sees each shard's bytes."""
    lt, r = world
    negative_control(lt, r, seed=81, prefix=PREFIX, tail=30, tp_rank=1)


def test_one_shards_failed_block_is_recomputed_on_every_shard(world):
    """Worker 1 of B fails one block; worker 0 loads all of its shard: vLLM recomputes the
    block (and the ones after it) on both workers, so no forward mixes a loaded shard with
    a missing one."""
    lt, r = world
    a, b = r.replicas
    s = primed(lt, r, seed=71, prefix=PREFIX, tail=30)
    before = lt.run(b.counters())
    lt.run(b.hook_all("inject_fault", "fail_one_block", 1, 1))  # worker 1 only
    out = lt.run(b.generate([s.asked]))
    c = delta(before, lt.run(b.counters()))
    blocks = PREFIX // BLOCK
    assert c["faults_fail_one_block"] == 1
    assert c["blocks_written"] == TP * blocks - 1  # worker 0 wrote all of its shard
    faults = lt.run(b.hook_all("recorded_faults"))
    assert faults[0] == [] and len(faults[1]) == 1
    [(group, block)] = faults[1]
    # recomputed on worker 1 (no longer the zeros the fault left there) ...
    assert lt.run(b.hook_all("engine_block_is_zero", group, block)) == [False] * TP
    # ... and nothing computed against the failed block was published, on either worker
    assert lt.run(b.hook_all("stored_vs_engine_mismatches")) == [[]] * TP
    if DEVICE == "cpu":
        assert out[0]["ids"] == s.base
    assert leases(lt, r) == 0
