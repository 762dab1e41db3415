"""Cross-replica prefix hits end to end: two real vLLM engines with Xavier, each in its own
xoscar sub pool (its engine core a further process), the directory in the test's pool (the
shared ``qwen_pair`` world, reset before each test: ``tests/support/worlds.py``).

The baselines and the scenarios (hit, negative control, failed block) are those of
``tests/support/scenarios.py``.  On CPU, B's tokens must also equal a run that computes the
whole prompt.  Every load is also checked byte for byte: the bytes in B's destination blocks
against the bytes in A's storage.
"""

import time
from typing import Tuple

import pytest

from xinference.model.llm.vllm.xavier.planning.options import DEFAULT_SWITCH_INTERVAL_US

from .support.loop_thread import LoopThread
from .support.processes import tokens
from .support.scenarios import (
    assert_loaded_bytes_exact,
    baseline_then_prime,
    block_names_of,
    cross_replica_hit,
    delta,
    leases,
    negative_control,
    primed,
    serve_with_one_failed_block,
    until_whole_launch,
)
from .support.worlds import DEVICE, KV_CACHE_DTYPE, World, assert_cuda_graphs_unless_eager
from .support.xavier_replicas import Replicas

pytestmark = pytest.mark.slow

PREFIX = 512  # tokens: 32 blocks of 16
BLOCK = 16


@pytest.fixture
def world(qwen_pair: World) -> Tuple[LoopThread, Replicas]:
    return qwen_pair.pair


def test_vllm_defaults_are_kept(world):
    """Xavier leaves vLLM's speed settings as vLLM chooses them: async scheduling where
    vLLM has it (the GPU; vLLM's CPU platform turns it off), CUDA graphs on the GPU."""
    lt, r = world
    settings = lt.run(r.replicas[0].engine_settings())
    print(f"\nvLLM settings with Xavier: {settings}")
    # the one interpreter setting Xavier changes in vLLM's engine process (the GIL)
    assert lt.run(r.replicas[0].hook("switch_interval_us")) == DEFAULT_SWITCH_INTERVAL_US
    assert_cuda_graphs_unless_eager(settings)


def test_the_kv_cache_dtype_asked_for_is_the_one_shared(world):
    """With ``XAVIER_TEST_KV_CACHE_DTYPE=fp8`` every test of this module runs on an fp8 KV
    cache: vLLM runs it (its settings) and the data plane copies 1-byte caches (vLLM types
    them ``uint8`` or ``float8_e4m3fn``), not the model's bf16."""
    lt, r = world
    settings = lt.run(r.replicas[0].engine_settings())
    dtypes = lt.run(r.replicas[0].hook("engine_cache_dtypes"))
    print(f"\nkv_cache_dtype {settings['kv_cache_dtype']}, cache tensors {dtypes}")
    assert settings["kv_cache_dtype"] == (KV_CACHE_DTYPE or "auto")
    if KV_CACHE_DTYPE.startswith("fp8"):
        assert set(dtypes) <= {"torch.uint8", "torch.float8_e4m3fn", "torch.float8_e5m2"}
    else:
        assert dtypes == ["torch.bfloat16"]


def test_cross_replica_hit_gives_baseline_tokens_in_one_load_call(world):
    lt, r = world
    a, b = r.replicas
    # B's mapping thread maps A ahead, off the step's path; its first try can come before
    # A's storage is up (a loaded machine: the world just started), then it tries again
    # PREMAP_RETRY_S later.  Wait for that map: the hit below must pay no mapping.
    deadline = time.monotonic() + 60
    while lt.run(b.counters()).get("peers_mapped_ipc", 0) < 1:
        assert time.monotonic() < deadline, "B's mapping thread never mapped A (60 s)"
        time.sleep(0.2)
    # B's scheduler maps A's host index once the directory announced it (A announced it
    # as it registered; B asks every second, from its lookups): then B finds A's blocks
    # without a directory round trip
    lt.run(a.generate([tokens(8, 40)]))  # (A publishes two blocks at least once)
    while lt.run(b.counters()).get("host_index_peers", 0) < 1:
        assert time.monotonic() < deadline, "B's scheduler never mapped A's host index"
        lt.run(b.generate([tokens(7, 20)]))
        time.sleep(0.5)
    stats_before = lt.run(b.connector_stats())
    hit = cross_replica_hit(lt, r, seed=1, prefix=PREFIX)
    out, c = hit.out, hit.counters
    # found in A's host index: no directory lookup on the hit's path (issue #34)
    assert c["host_index_hits"] == 1 and c["host_index_blocks"] == PREFIX // BLOCK
    assert c.get("lookup_calls", 0) == 0 and c.get("queries", 0) == 0
    if DEVICE == "cpu":  # CPU kernels: also equal to computing the whole prompt
        lt.run(a.reset_prefix_cache())
        assert out["ids"] == lt.run(a.generate([hit.scenario.asked], xavier=False))[0]["ids"]
    assert c["hit_blocks"] == PREFIX // BLOCK and c["blocks_written"] == PREFIX // BLOCK
    # B's mapping thread had mapped A while A computed the prefix: the hit paid no mapping
    assert c.get("peer_map_us", 0) == 0 and c.get("load_launch_cpu_us", 0) > 0
    assert c["batch_calls"] == 1 == c["steps_with_loads"]
    assert c["load_failures"] == 0 and c["rejected_batches"] == 0
    # the load read device memory (A's cache, mapped), unordered after B's forward in
    # flight: it was reported when vLLM first asked, or counted as late
    print(f"\nreported at once {c.get('loads_reported_at_once', 0)}, late "
          f"{c.get('report_wait_missed', 0)}, waited {c.get('report_wait_us', 0)} us")
    assert c.get("loads_reported_at_once", 0) + c.get("report_wait_missed", 0) == 1
    # every read was checked after its copy against A's generations file, and held
    assert c["reads_validated"] == PREFIX // BLOCK and c["validation_failures"] == 0
    # read straight from A's own vLLM cache (CUDA IPC on the GPU machine; on the CPU
    # machine the cache A's worker moved into shared memory), no Xavier tier involved
    assert c["rows_from_vllm_cache"] == PREFIX // BLOCK
    assert c.get("rows_from_gpu_tier", 0) == 0 == c.get("rows_from_cpu_tier", 0)
    if DEVICE == "cuda":  # vLLM's caches (permuted within a block) take the fused kernel
        assert c["fused_transfers"] == c["transfers"] > 0
    assert_loaded_bytes_exact(lt, r, PREFIX // BLOCK)
    # vLLM's own connector statistics (its "KV Transfer metrics" line) carry the same load
    vllm_stats = delta(stats_before, lt.run(b.connector_stats()))
    assert vllm_stats.get("blocks_written") == c["blocks_written"]
    assert vllm_stats.get("useful_bytes") == c["useful_bytes"] > 0
    assert vllm_stats.get("batch_calls") == 1
    assert leases(lt, r) == 0
    # the default transport maps a peer of the same host (test_nixl_endpoint: through NIXL)
    mapped = lt.run(b.counters())
    assert mapped.get("peers_mapped_ipc") == 1 and mapped.get("peers_mapped_nixl", 0) == 0
    metrics = lt.run(b.metrics_text())
    assert 'xavier_blocks_written_total{rank="2"}' in metrics
    # a miss is counted too (its step has no load call: the figures ride on the export
    # call).  Both replicas of the launch are on this host and each announced its host
    # index: B's scheduler says so once it polled the directory after both announced
    while lt.run(b.counters()).get("host_index_whole_launch", 0) != 1:
        assert time.monotonic() < deadline + 60, "B never saw the whole launch's indexes"
        lt.run(b.generate([tokens(7, 20)]))
        time.sleep(0.5)
    # then a prompt no index names is a miss at once: no directory lookup on its path
    before = lt.run(b.counters())
    started = time.monotonic()
    lt.run(b.generate([tokens(99, 200)]))
    took_ns = 1e9 * (time.monotonic() - started)
    c = delta(before, lt.run(b.counters()))
    assert c["lookups_skipped_held_nowhere"] == 1 and c["hit_blocks"] == 0
    assert c.get("queries", 0) == 0 and c.get("lookup_calls", 0) == 0
    # the cost model measured B while it served (the tests load every hit they are offered:
    # XAVIER_LOAD_POLICY=always, conftest.py): the hit's wait, and a prefill time per token
    # that a 200-token prompt's whole request took longer than; nothing declined
    for n in (40, 300, 120):  # steps of varied sizes for its fit, whatever ran before
        lt.run(b.generate([tokens(100 + n, n)]))
    now = lt.run(b.counters())
    assert now.get("hits_declined", 0) == 0 and now.get("lookups_skipped_not_paying", 0) == 0
    print(f"cost model: {now.get('cost_prefill_ns_per_token', 0)} ns a prefill token, "
          f"{now.get('cost_step_fixed_us', 0)} us a step, a hit waits "
          f"{now.get('cost_hit_wait_us', 0)} us")
    assert now.get("cost_hit_wait_us", 0) > 0
    assert 0 < now.get("cost_prefill_ns_per_token", 0) * 200 < took_ns
    # every step's time in the connector (scheduler half + worker half) was measured: the
    # longest, and a histogram whose counts fall with its bounds (planning/step_hold.py)
    over = [now.get(f"steps_held_over_{ms}ms", 0) for ms in (10, 50, 250)]
    print(f"step hold: longest {now.get('step_hold_max_us', 0)} us, over 10/50/250 ms {over}")
    assert now.get("step_hold_max_us", 0) > 0
    assert over[0] >= over[1] >= over[2] and over[0] < now["scheduler_steps"]
    assert (now["step_hold_max_us"] > 10_000) == (over[0] > 0)


def test_negative_control_copy_skipped_changes_tokens(world):
    """The same checks as above catch a hit whose copy did not happen."""
    lt, r = world
    negative_control(lt, r, seed=11, prefix=PREFIX)


def test_failed_block_is_recomputed_by_vllm(world):
    lt, r = world
    s = primed(lt, r, seed=21, prefix=PREFIX)
    ids = serve_with_one_failed_block(lt, r, s.asked, PREFIX // BLOCK)
    if DEVICE == "cpu":
        # CPU kernels give the same bytes whatever the shape: tokens equal the baseline.  On
        # the GPU, blocks 16-31 are recomputed in another shape than A computed them, which
        # may change low bits (then tokens too): that is vLLM's recompute, not a load.
        assert ids == s.base


def test_concurrent_requests_share_one_load_call_per_step(world):
    lt, r = world
    a, b = r.replicas
    prefixes = [tokens(100 + i, 256) for i in range(6)]
    asked = [p + tokens(200 + i, 30) for i, p in enumerate(prefixes)]
    prime = [p + tokens(300 + i, 30) for i, p in enumerate(prefixes)]
    base = baseline_then_prime(lt, r, asked, prime, local_hit=256)
    before = lt.run(b.counters())
    out = lt.run(b.generate(asked))
    c = delta(before, lt.run(b.counters()))
    if DEVICE == "cpu":  # GPU GEMMs vary with the batch's shape, which arrival times decide
        assert [o["ids"] for o in out] == base
    with_hits = sum(1 for o in out if o["cached"] > 0)
    assert with_hits == 6
    assert c["logical_requests"] == with_hits == c["requests_with_hits"]
    assert c["batch_calls"] == c["steps_with_loads"] >= 1
    assert c["batch_calls"] < with_hits  # batched: fewer calls than requests
    assert_loaded_bytes_exact(lt, r, 6 * 256 // BLOCK)
    assert leases(lt, r) == 0


def test_block_hashes_come_from_the_launchs_secret_seed(world):
    """#23: the engine seeds vLLM's block hashes with the launch's secret seed, drawn by
    the directory and fetched by each replica's engine core (both replicas share, as the
    other tests show): the blocks A exports are named by hashes chained from that seed, not
    from the public seed "0" used before; no engine process carries ``PYTHONHASHSEED``."""
    import psutil

    lt, r = world
    a, _ = r.replicas
    seed = lt.run(r.tracker.hash_seed())
    assert isinstance(seed, str) and len(seed) == 64
    prompt = tokens(41, PREFIX) + tokens(42, 8)
    lt.run(a.reset_prefix_cache())
    lt.run(a.reset_recent_loads())
    lt.run(a.generate([prompt]))
    lt.run(a.flush())
    exported = {k for g, k in lt.run(a.recent_export_keys()) if g == 0}
    expected = block_names_of(seed, prompt)
    assert len(expected) == PREFIX // BLOCK and set(expected) <= exported
    assert not set(block_names_of("0", prompt)) & exported  # control: the old public seed
    pids = lt.run(a.engine_pids())
    assert pids
    for pid in pids:
        try:
            env = psutil.Process(pid).environ()
        except psutil.NoSuchProcess:
            continue
        assert "PYTHONHASHSEED" not in env and seed not in "".join(env.values())


def test_a_forged_short_key_collision_is_never_loaded(world):
    """#23: blocks registered under names that share only the low 63 bits with the blocks of
    B's prompt (what a forger with a known seed could make) give B no hit: tokens equal
    the no-sharing run, nothing loaded, the directory counts the mismatch.  The forger is
    a rank of its own that announced no host index (as a replica of another host): so B's
    scheduler no longer takes its host's indexes for the whole launch and asks the
    directory, whose full-width check is what this test is about."""
    lt, r = world
    _, b = r.replicas
    prompt = tokens(43, PREFIX) + tokens(44, 8)
    real = block_names_of(lt.run(r.tracker.hash_seed()), prompt)
    forged = [(0, name ^ (1 << 100), 0, 60_000 + i, 1) for i, name in enumerate(real)]
    assert lt.run(r.tracker.register(9, forged)) == len(forged)
    try:
        deadline = time.monotonic() + 60
        while lt.run(b.counters()).get("host_index_whole_launch", 0) != 0:
            assert time.monotonic() < deadline, "B never saw rank 9 join the launch"
            lt.run(b.generate([tokens(7, 20)]))  # (B's steps poll the directory)
            time.sleep(0.5)
        before, stats = lt.run(b.counters()), lt.run(r.tracker.stats())
        got = lt.run(b.generate([prompt]))[0]
        c = delta(before, lt.run(b.counters()))
        assert got["cached"] == 0 and c["hit_blocks"] == 0 and c["blocks_written"] == 0
        assert c["queries"] == 1 and c.get("lookups_skipped_held_nowhere", 0) == 0
        after = lt.run(r.tracker.stats())
        assert after["identity_mismatches"] - stats["identity_mismatches"] >= 1
        lt.run(b.reset_prefix_cache())
        assert got["ids"] == lt.run(b.generate([prompt], xavier=False))[0]["ids"]
    finally:
        lt.run(r.tracker.unregister_rank(9))
    assert leases(lt, r) == 0


def test_a_replica_of_another_host_joining_brings_the_directory_up_to_date(world):
    """Both replicas on this host (the shared world): A publishes the blocks of its vLLM
    cache into its host index only, where B finds them; the directory lists none.  A
    replica of another host joins (rank 9: registered, no index announced here): before
    its next publication A registers again every block it still holds, so that the new
    replica would find them through the directory.  Rank 9 goes: A drops them from the
    directory again.  B's hit from A's index holds throughout (tokens: the baseline)."""
    lt, r = world
    a, _ = r.replicas
    until_whole_launch(lt, a, 1, "A never saw the whole launch on this host")
    s = primed(lt, r, seed=71, prefix=PREFIX)
    lt.run(a.flush())
    names = block_names_of(lt.run(r.tracker.hash_seed()), s.asked)[:PREFIX // BLOCK]

    def listed() -> int:  # what the directory answers a replica of another host
        return lt.run(r.tracker.query_many([0], [names], 9, False))[0].num_hits

    assert listed() == 0
    before = lt.run(a.counters())
    lt.run(r.tracker.register_rank(9))
    try:
        until_whole_launch(lt, a, 0, "A never saw rank 9 join the launch")
        assert listed() == PREFIX // BLOCK
        assert delta(before, lt.run(a.counters()))["in_place_republished"] >= PREFIX // BLOCK
    finally:
        lt.run(r.tracker.unregister_rank(9))
    until_whole_launch(lt, a, 1, "A never saw rank 9 leave")
    assert listed() == 0
    hit = cross_replica_hit(lt, r, seed=72, prefix=PREFIX)  # B still finds A's blocks
    assert hit.counters["host_index_hits"] == 1 and hit.counters.get("queries", 0) == 0
    assert leases(lt, r) == 0


def test_prompt_logprob_requests_never_load(world):
    """#23: vLLM reads no prefix cache for a request that asks for prompt logprobs (every
    prompt token must be computed); Xavier offers it no load either, though another
    replica holds its prefix: its prompt logprobs equal the no-sharing run's.  Control: the
    same prompt without prompt logprobs is a hit."""
    lt, r = world
    a, b = r.replicas
    shared = tokens(45, PREFIX)
    lt.run(a.generate([shared + tokens(46, 8)]))  # A computes and exports the prefix
    lt.run(a.flush())
    asked = shared + tokens(47, 8)
    lt.run(b.reset_prefix_cache())
    before = lt.run(b.counters())
    got = lt.run(b.generate([asked], prompt_logprobs=1))[0]
    c = delta(before, lt.run(b.counters()))
    assert got["cached"] == 0 and c["hit_blocks"] == 0 and c["queries"] == 0
    lt.run(b.reset_prefix_cache())
    alone = lt.run(b.generate([asked], xavier=False, prompt_logprobs=1))[0]
    assert got["prompt_logprobs"] == alone["prompt_logprobs"] and got["ids"] == alone["ids"]
    assert len(got["prompt_logprobs"]) == len(asked)
    lt.run(b.reset_prefix_cache())
    before = lt.run(b.counters())
    hit = lt.run(b.generate([asked]))[0]
    assert hit["cached"] == PREFIX  # the control
    assert delta(before, lt.run(b.counters()))["hit_blocks"] == PREFIX // BLOCK
    assert leases(lt, r) == 0


def test_cache_salts_keep_tenants_apart_across_replicas(world):
    """vLLM folds ``cache_salt`` into its block hashes: the same tokens under another salt
    are never a hit from another replica (tokens equal the no-sharing run); under the same
    salt they are (#23)."""
    lt, r = world
    a, b = r.replicas
    shared = tokens(31, PREFIX)
    lt.run(a.reset_prefix_cache())
    lt.run(b.reset_prefix_cache())
    lt.run(a.generate([shared + tokens(32, 40)], cache_salt="tenant-a"))  # A exports, salted
    lt.run(a.flush())  # published
    asked = shared + tokens(33, 40)
    before = lt.run(b.counters())
    other = lt.run(b.generate([asked], cache_salt="tenant-b"))[0]
    c = delta(before, lt.run(b.counters()))
    assert other["cached"] == 0 and c["hit_blocks"] == 0 and c["blocks_written"] == 0
    # the no-sharing run on B (A keeps its salted prefix: it is shared from A's own cache,
    # which a reset of A's prefix cache would forget)
    lt.run(b.reset_prefix_cache())
    alone = lt.run(b.generate([asked], xavier=False, cache_salt="tenant-b"))[0]
    lt.run(b.reset_prefix_cache())
    assert other["ids"] == alone["ids"]
    before = lt.run(b.counters())
    same = lt.run(b.generate([asked], cache_salt="tenant-a"))[0]
    c = delta(before, lt.run(b.counters()))
    assert same["cached"] == PREFIX and c["hit_blocks"] == PREFIX // BLOCK
    if DEVICE == "cpu":  # CPU kernels: a loaded prefix gives the whole-prompt tokens
        assert same["ids"] == alone["ids"]
    assert leases(lt, r) == 0


def test_the_shared_world_forgets_every_prefix_at_its_reset(qwen_pair):
    """What the shared world's reset between tests (``tests/support/worlds.py``) promises
    the next test: a prefix A exported is listed in the directory until the reset and a
    miss after it (nothing stored, nothing listed, B's and A's local prefix caches empty);
    B's own blocks of that request are forgotten by the next reset too; the counters since
    a reset are the test's own.  Control: the same scenario without a reset in between is a
    hit (the other tests of this module)."""
    lt, r = qwen_pair.pair
    a, b = r.replicas
    s = primed(lt, r, seed=51, prefix=256)
    # A's blocks are published: into its host index only while the whole launch is on
    # this host (B finds them there; the directory lists none), else listed in the
    # directory too (test_a_replica_of_another_host_... switches between the two)
    kept_local = qwen_pair.since_reset(0).get("in_place_kept_local", 0)
    assert kept_local + lt.run(r.tracker.stats())["blocks"] >= 256 // BLOCK
    in_place = qwen_pair.since_reset(0).get("in_place_registered", 0)
    report = qwen_pair.reset()
    # published in place (A's own cache, the default): nothing was copied into A's storage
    # and the blocks leave the directory with A's prefix-cache reset (checked below)
    assert in_place >= 256 // BLOCK and report.cleared_blocks == 0
    assert report.directory_blocks == 0 and report.outstanding_leases == 0
    out = lt.run(b.generate([s.asked]))[0]
    assert out["cached"] == 0 and out["ids"] == s.base  # computed by B: a miss
    since = qwen_pair.since_reset(1)
    assert since["queries"] == 1 and since.get("hit_blocks", 0) == 0
    idle = qwen_pair.since_reset(0)  # A served nothing since the reset
    assert idle.get("queries", 0) == 0 and idle.get("export_exported", 0) == 0
    assert idle.get("in_place_published", 0) == 0
    lt.run(b.flush())
    kept_local = qwen_pair.since_reset(1).get("in_place_kept_local", 0)
    assert kept_local + lt.run(r.tracker.stats())["blocks"] > 0  # B published what it
    # computed ...
    qwen_pair.reset()
    again = lt.run(b.generate([s.asked]))[0]
    assert again["cached"] == 0  # ... and the reset forgot that too
    assert leases(lt, r) == 0
