"""Reliability suite (issue #8) on real parts: two vLLM CPU engines with Xavier in their own
xoscar sub pools (as in ``test_connector_e2e``), the real directory, real processes killed.

Each scenario records a row of the summary that pytest prints at the end (faults tried,
survived, requests completed, leaks found); ``doc/reliability.md`` quotes a run.  "Leaks" are
counted, not assumed: outstanding directory leases, shared-memory tier files of dead
processes, engine-core processes of a killed replica still running.

Faults that cannot be caused on demand in a real engine use the transfer actor's test-only
fault switch (``stall_load``: hold a load call after its leases were granted); every such
test also checks the real outcome (tokens, bytes, leases).  The world is the shared
``qwen_pair`` (reset before each test); the directory restart and the killed source rank
leave it unusable (the directory's new seed, a dead replica): they are marked
``breaks_world`` and run last among its users.
"""

import asyncio
import os
import re
import signal
import time
from typing import List, Tuple

import numpy as np
import psutil
import pytest

from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import remove_orphaned_shm_files
from xinference.model.llm.vllm.xavier.planning.block_names import row_key

from .support.loop_thread import LoopThread
from .support.processes import tokens
from .support.reliability import record
from .support.scenarios import delta, leases, until_whole_launch
from .support.worlds import World
from .support.xavier_replicas import Replicas

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture
def world(qwen_pair: World) -> Tuple[LoopThread, Replicas]:
    return qwen_pair.pair


def exported_on_a(lt: LoopThread, r: Replicas, prefix: List[int], asked: List[int]) -> List[int]:
    """Tokens of ``asked`` computed on A without sharing; then A (cache reset) serves a
    prompt with ``prefix`` with sharing on, exporting its blocks."""
    a, _ = r.replicas
    base = lt.run(a.generate([asked], xavier=False))[0]["ids"]
    lt.run(a.reset_prefix_cache())
    lt.run(a.reset_recent_loads())
    lt.run(a.generate([prefix + tokens(len(prefix), 20)]))
    return base


def prefix_keys(lt: LoopThread, r: Replicas, n: int) -> List[int]:
    """Directory keys of the first ``n`` blocks A exported since ``exported_on_a``."""
    keys = [k for g, k in lt.run(r.replicas[0].recent_export_keys()) if g == 0]
    assert len(keys) >= n
    return keys[:n]


def test_malformed_metadata_is_refused_nothing_written_engine_keeps_serving(world):
    lt, r = world
    a, b = r.replicas
    prefix = tokens(1, 128)
    asked = prefix + tokens(2, 20)
    # the locations below are read from the directory: with a rank "of another host"
    # registered, A publishes its in-place blocks there too (not only in its host index)
    lt.run(r.tracker.register_rank(9))
    try:
        until_whole_launch(lt, a, 0, "A never saw rank 9 join the launch")
        base = exported_on_a(lt, r, prefix, asked)
        lt.run(a.flush())
        metadata_refused(lt, r, base, prefix, asked)
    finally:
        lt.run(r.tracker.unregister_rank(9))


def metadata_refused(lt: LoopThread, r: Replicas, base: List[int], prefix: List[int],
                     asked: List[int]) -> None:
    a, b = r.replicas
    n_blocks = lt.run(b.engine_num_blocks())
    # real locations in A's storage: ask the directory as B's scheduler would
    ks = prefix_keys(lt, r, 128 // BLOCK)
    hit = lt.run(r.tracker.query(0, ks, 2))
    assert hit.num_hits == len(ks) == 8
    loc = hit.locations[0]
    lt.run(r.tracker.release(list(hit.lease_ids)))
    assert leases(lt, r) == 0, lt.run(r.tracker.stats())
    dest = n_blocks - 1  # a block B's vLLM has not handed out in this short run
    src_digest = lt.run(a.stored_block_digests([(0, ks[0])]))[(0, ks[0])]
    assert lt.run(b.engine_block_digests(0, [dest]))[0] != src_digest  # a write would show
    # a load row: its key, and the identity the directory promised (generation, storage)
    good = [0, row_key(ks[0]), loc.rank, loc.tier, loc.slot, dest, loc.generation,
            loc.incarnation]

    def row(key, slot, to):
        return [0, row_key(key), loc.rank, loc.tier, slot, to, loc.generation, loc.incarnation]

    def meta(table, offsets=None, ids=("r",)):
        return dict(request_ids=ids, offsets=np.asarray(offsets or [0, len(table)]),
                    table=table)

    # (leases are the scheduler half's, not a load's: the rows read A's storage unleased)
    cases = {
        "table": lambda: meta(np.asarray([good[:5]], np.int64)),  # a column missing (layout)
        "table ": lambda: meta(np.asarray([good], np.float64)),  # wrong dtype
        "dest": lambda: meta(np.asarray([good, row(ks[1], loc.slot, n_blocks + 7)],
                                        np.int64)),  # out of range, after a valid row
        "conflicting writes": lambda: meta(np.asarray(
            [good, row(ks[1], hit.locations[1].slot, dest)], np.int64)),
        "slot": lambda: meta(np.asarray([good, row(ks[1], 10**9, 5)], np.int64)),
        "offsets": lambda: meta(np.asarray([good], np.int64), offsets=[0, 2]),
        "request_ids": lambda: meta(np.asarray([good, good], np.int64), offsets=[0, 1, 2],
                            ids=("same", "same")),
    }
    before = lt.run(b.counters())
    survived = 0
    for field_name, make in cases.items():
        out = lt.run(b.raw_load(**make()))
        assert out["written"] == 0, field_name
        # the message names the field (after the exception's type, where one is given)
        assert re.match(rf"^(\w+: )?{field_name.strip()}", out["error"]), out["error"]
        assert lt.run(b.engine_block_digests(0, [dest]))[0] != src_digest, field_name
        survived += 1
    after = lt.run(b.counters())
    refused = sum(after.get(k, 0) - before.get(k, 0)
                  for k in ("rejected_metadata", "rejected_batches"))
    assert refused == len(cases)
    # duplicate identical destinations are not an error: deduplicated, written once
    dup = meta(np.asarray([good, good], np.int64), offsets=[0, 1, 2], ids=("x", "y"))
    out = lt.run(b.raw_load(**dup))
    assert not out.get("error") and out["failed"] == []
    assert out["written"] == 1 and lt.run(b.engine_block_digests(0, [dest]))[0] == src_digest
    # the engine keeps serving, and right
    got = lt.run(b.generate([asked]))[0]
    assert got["ids"] == base
    record("malformed step metadata (live worker)", len(cases) + 1, survived + 1, 1,
           leases(lt, r), f"{len(cases)} refused naming the field, dedup ok, tokens == baseline")


def test_repeated_cancellation_during_loads_then_200_requests(world):
    lt, r = world
    a, b = r.replicas
    rounds, completed = 12, 0
    start = lt.run(b.counters())
    for i in range(rounds):
        prefix = tokens(1000 + i, 256)
        lt.run(a.generate([prefix + tokens(2000 + i, 16)], max_tokens=2))  # export on A
        prompts = [prefix + tokens(3000 + 10 * i + j, 16) for j in range(4)]
        completed += lt.run(b.generate_then_cancel(prompts, after_s=0.05 + 0.05 * (i % 4)))
        assert leases(lt, r) == 0 or _settles(lt, r)
    # then 200 requests over both replicas, 20 shared prefixes, all must finish
    groups = [tokens(5000 + g, 64) for g in range(20)]
    prompts = [groups[i % 20] + tokens(6000 + i, 8) for i in range(200)]

    async def all_200():
        sem = asyncio.Semaphore(16)

        async def one(i):
            async with sem:
                return (await r.replicas[i % 2].generate([prompts[i]], max_tokens=2))[0]

        return await asyncio.gather(*(one(i) for i in range(200)))

    outs = lt.run(all_200())
    assert len(outs) == 200 and all(len(o["ids"]) == 2 for o in outs)
    c = lt.run(b.counters())
    for k in ("load_failures", "rejected_batches", "rejected_metadata"):
        assert c.get(k, 0) == start.get(k, 0), k
    left = leases(lt, r)
    assert left == 0
    record("cancel streaming requests during loads", rounds * 4, rounds * 4,
           200 + completed, left, f"{rounds} rounds x 4 cancelled; then 200 of 200 finished")


def test_a_request_aborted_while_vllm_waits_for_its_load_releases_everything(world):
    """vLLM keeps an async-loading request in WAITING_FOR_REMOTE_KVS until the worker
    reports its load; aborted meanwhile, its blocks stay allocated until then (vLLM's
    ``delay_free_blocks``) and the worker must still report it.  Here the load is done
    but its report held back (``hold_finish``) while the request is aborted: no crash, no
    lease left, the engine serves on, and the blocks come back."""
    lt, r = world
    a, b = r.replicas
    prefix = tokens(8000, 256)
    base = exported_on_a(lt, r, prefix, prefix + tokens(8001, 20))
    before = lt.run(b.counters())
    lt.run(b.inject_fault("hold_finish", 1))
    cancelled = lt.run(b.generate_then_cancel([prefix + tokens(8002, 20)], after_s=1.0))
    assert cancelled == 0  # it could not finish: its load was not reported yet
    after = lt.run(b.counters())
    assert after.get("faults_hold_finish", 0) - before.get("faults_hold_finish", 0) == 1
    assert after.get("hit_blocks", 0) - before.get("hit_blocks", 0) == 256 // BLOCK
    time.sleep(4)  # the hold ends: the load is reported, vLLM frees the aborted request
    assert _settles(lt, r)
    out = lt.run(b.generate([prefix + tokens(8001, 20)]))[0]  # the engine serves on
    assert out["ids"] == base and out["cached"] >= 256 - BLOCK
    left = leases(lt, r)
    assert left == 0
    record("request aborted while its async load is pending", 1, 1, 2, left,
           "reported after the abort, blocks freed, engine serves on, tokens == baseline")


def _settles(lt: LoopThread, r: Replicas, timeout: float = 10.0) -> bool:
    """Leases of aborted requests are released by the scheduler half (at
    ``request_finished``, or when vLLM reports an aborted request's load done): allow the
    engine a moment."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if leases(lt, r) == 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.breaks_world
def test_directory_restart_then_ranks_reregister_misses_then_hits(world, qwen_pair):
    import xoscar as xo

    from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker

    lt, r = world
    # the new directory draws a new block-hash seed, which the engines never fetch again
    qwen_pair.mark_broken("directory restarted")
    a, b = r.replicas
    old_prefix = tokens(7000, 128)
    old_asked = old_prefix + tokens(7001, 20)
    base_old = exported_on_a(lt, r, old_prefix, old_asked)
    address, uid = r.tracker.address, r.tracker.uid
    lt.run(xo.destroy_actor(r.tracker))
    # while the directory is gone: no error; B still finds A's blocks in A's host index
    # (this host's peers need no directory), else a miss
    gone = lt.run(b.counters())
    during = lt.run(b.generate([old_asked]))[0]
    from_host = delta(gone, lt.run(b.counters())).get("host_index_hits", 0)
    assert during["ids"] == base_old and during["cached"] == (128 if from_host else 0)
    lt.run(b.reset_prefix_cache())
    lt.run(xo.create_actor(VLLMBlockTracker, address=address, uid=uid))
    # A's old blocks are unknown to the new directory: no hit through it (a recompute, or
    # A's host index again), right tokens
    before = lt.run(b.counters())
    again = lt.run(b.generate([old_asked]))[0]
    assert again["ids"] == base_old
    through_directory = delta(before, lt.run(b.counters()))
    assert (through_directory.get("hit_blocks", 0)
            == through_directory.get("host_index_blocks", 0))
    # ranks register again with their next export: new prefixes hit
    new_prefix = tokens(7100, 128)
    new_asked = new_prefix + tokens(7101, 20)
    base_new = exported_on_a(lt, r, new_prefix, new_asked)
    before = lt.run(b.counters())
    hit = lt.run(b.generate([new_asked]))[0]
    assert hit["ids"] == base_new
    gained = lt.run(b.counters()).get("hit_blocks", 0) - before.get("hit_blocks", 0)
    assert gained == 128 // BLOCK
    left = leases(lt, r)
    assert left == 0
    record("directory actor restart", 1, 1, 4, left,
           "host-index hit (or miss) while gone, no directory hit after restart, then a hit")


@pytest.mark.breaks_world
def test_source_rank_killed_during_a_load(world, qwen_pair):
    lt, r = world
    qwen_pair.mark_broken("replica A killed")
    a, b = r.replicas
    prefix = tokens(9000, 256)
    asked = prefix + tokens(9001, 20)
    base = exported_on_a(lt, r, prefix, asked)
    a_pid = lt.run(a.transfer_pid())
    a_children = psutil.Process(a_pid).children(recursive=True)
    shm_before = [f for f in os.listdir("/dev/shm") if f.startswith(f"xavier-{a_pid}-")
                  and not f.endswith(".owner")]  # A's files, not its owner lock
    assert shm_before  # A's storage tier lives there
    before = lt.run(b.counters())
    lt.run(b.inject_fault("stall_load", 1))
    fut = asyncio.run_coroutine_threadsafe(b.generate([asked]), lt.loop)
    deadline = time.monotonic() + 60
    while lt.run(b.counters()).get("faults_stall_load", 0) == before.get("faults_stall_load", 0):
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.05)
    # the load holds its leases; now the source dies, and Xinference's recovery tells the
    # directory and the remaining ranks
    os.kill(a_pid, signal.SIGKILL)
    lt.run(r.tracker.unregister_rank(1))
    world_now = list(r.addresses)
    world_now[1] = ""
    lt.run(b.update_world(world_now))
    out = fut.result(timeout=120)[0]  # no hang
    assert out["ids"] == base
    after = lt.run(b.counters())
    assert after.get("hit_blocks", 0) - before.get("hit_blocks", 0) == 256 // BLOCK  # claimed
    # ... and not loaded: the source was gone, vLLM recomputed those blocks
    assert after.get("rows_unreachable", 0) - before.get("rows_unreachable", 0) == 256 // BLOCK
    leaks = leases(lt, r)
    # the killed replica's engine core goes with it; its shared-memory files are swept
    gone = psutil.wait_procs(a_children, timeout=60)[1]
    leaks += len(gone)
    removed = remove_orphaned_shm_files()
    # its files and its owner lock (the lock free once A died: planning/shm_words.py)
    leaks += len([f for f in os.listdir("/dev/shm") if f.startswith(f"xavier-{a_pid}-")])
    assert leaks == 0, (leaks, gone)
    assert len([p for p in removed if f"xavier-{a_pid}-" in p]) == len(shm_before)
    # B keeps serving
    again = lt.run(b.generate([tokens(9100, 64)], max_tokens=4))
    assert len(again[0]["ids"]) == 4
    record("source rank killed mid-load (SIGKILL)", 1, 1, 2, leaks,
           f"recomputed, tokens == baseline; {len(shm_before)} shm files swept")
