"""vLLM's own KV cache read in place, on real engines whose caches hold a few prompts (#33).

A source publishes the blocks it computed in place (no copy); a peer reads them straight
from the source's vLLM cache and checks each read after its copy against the generation the
source bumps whenever vLLM hands the block out again.  Here the source really does hand them
out while a peer's load names them: the peer's load is held with its rows built (the
``hold_load`` fault: the real race's window, made certain), the source serves prompts that
reuse every block of its cache, then the load goes on.

* checked (the product): every such read fails its check, vLLM recomputes, tokens equal the
  no-sharing run;
* the negative control, the check switched off: the peer loads the new prompts' KV under the
  old names and its tokens differ -- the churn is real;
* the blocks the source handed out were saved into its Xavier tier before they were
  overwritten -- those shown to be shared (``xavier_save_victims`` shared, the default: it
  loaded them), never a copy a peer still holds nor one nobody else ever held -- and a
  later peer still loads the prefix from there, bit-exact.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Dict, List, Tuple

import pytest

from xinference.model.llm.vllm.xavier.mechanism.quiet_gate import MAX_DEFER_QUIETS
from xinference.model.llm.vllm.xavier.planning.options import DEFAULT_QUIET_MS

from .support.processes import tokens
from .support.scenarios import assert_loaded_bytes_exact, delta, leases, leases_settled
from .support.worlds import CHURN_BLOCKS, World

BLOCK = 16
PREFIX = 256  # 16 blocks
TAIL = 40


def _churn(lt: Any, source: Any, seed: int) -> None:
    """``source`` serves prompts that together need every block of its cache twice over,
    so every block it published before is handed out again."""
    per_prompt = 700  # 44 blocks: one at a time fits the cache
    rounds = 2 * CHURN_BLOCKS * BLOCK // per_prompt + 1
    for i in range(rounds):
        lt.run(source.generate([tokens(seed + i, per_prompt)], max_tokens=2))


def _held_load_after_churn(world: World, asked: List[int], checks: bool, release: str,
                           seed: int) -> Tuple[List[int], Dict[str, int], Dict[str, int]]:
    """B asks for ``asked`` (a hit on A's in-place prefix); its load is held with its rows
    built while A reuses every block; then it goes on.  B's tokens, B's and A's counters."""
    lt, r = world.pair
    a, b = r.replicas
    lt.run(b.hook_all("set_read_checks", checks))
    try:
        lt.run(b.hook("hold_next_load", release))
        before_a, before_b = lt.run(a.counters()), lt.run(b.counters())
        pending = asyncio.run_coroutine_threadsafe(b.generate([asked]), lt.loop)
        deadline = time.monotonic() + 120
        while lt.run(b.counters()).get("faults_hold_load", 0) == before_b.get(
                "faults_hold_load", 0):  # B's load holds: its rows name A's blocks
            assert time.monotonic() < deadline, "B's load never started (120 s)"
            assert not pending.done(), f"B answered without loading: {pending.result()}"
            time.sleep(0.05)
        _churn(lt, a, seed)
        ca = delta(before_a, lt.run(a.counters()))
        with open(release, "w"):
            pass
        out = pending.result(300)[0]
        cb = delta(before_b, lt.run(b.counters()))
    finally:
        lt.run(b.hook_all("set_read_checks", True))
        if os.path.exists(release):
            os.unlink(release)
    return out["ids"], cb, ca


def _published_prefix(lt: Any, holder: Any, baseline: Any, seed: int
                      ) -> Tuple[List[int], List[int], List[int]]:
    """``holder`` computes and publishes a fresh prefix (``tokens(seed)`` + a tail);
    returns ``(prefix, asked, base)``: ``asked`` is the prefix + another tail and ``base``
    its no-sharing tokens, computed by ``baseline`` with its cache reset afterwards."""
    prefix = tokens(seed, PREFIX)
    asked = prefix + tokens(seed + 1, TAIL)
    base = lt.run(baseline.generate([asked], xavier=False))[0]["ids"]
    lt.run(baseline.reset_prefix_cache())
    lt.run(holder.generate([prefix + tokens(seed + 2, TAIL)]))
    lt.run(holder.flush())
    return prefix, asked, base


@pytest.fixture
def prefix_on_a(churn_pair: World) -> Tuple[World, List[int], List[int]]:
    """A published a 256-token prefix in place; ``asked`` (the prefix + another tail) and
    its no-sharing tokens, computed by B with its cache reset afterwards."""
    lt, r = churn_pair.pair
    a, b = r.replicas
    _, asked, base = _published_prefix(lt, a, b, 61)
    assert churn_pair.since_reset(0).get("in_place_registered", 0) >= PREFIX // BLOCK
    return churn_pair, asked, base


def test_a_read_of_a_block_the_source_reused_fails_its_check(prefix_on_a, tmp_path):
    world, asked, base = prefix_on_a
    lt, r = world.pair
    ids, b, a = _held_load_after_churn(world, asked, True, str(tmp_path / "go"), 100)
    # A handed every published block of the prefix out again (and forgot them)
    assert a["in_place_reused"] >= PREFIX // BLOCK
    assert b["hit_blocks"] == PREFIX // BLOCK and b["rows_from_vllm_cache"] == PREFIX // BLOCK
    # every read was checked after its copy, none held: vLLM recomputed the prefix
    assert b["reads_validated"] == PREFIX // BLOCK == b["validation_failures"]
    assert b.get("blocks_written", 0) == 0 and b["load_failures"] == 1
    assert ids == base
    assert leases(lt, r) == 0


def test_negative_control_unchecked_reads_load_the_new_prompts_kv(prefix_on_a, tmp_path):
    """The same race with the check switched off: B loads whatever A's blocks hold now
    under the prefix's names, and its tokens show it."""
    world, asked, base = prefix_on_a
    ids, b, a = _held_load_after_churn(world, asked, False, str(tmp_path / "go"), 200)
    assert a["in_place_reused"] >= PREFIX // BLOCK
    assert b["blocks_written"] == PREFIX // BLOCK and b.get("validation_failures", 0) == 0
    assert b.get("reads_validated", 0) == 0
    assert ids != base  # wrong KV served: the churn is real


def _until_mapped(lt: Any, replica: Any, peer: Any, seed: int) -> None:
    """``replica``'s scheduler maps ``peer``'s host index once the directory announced it
    (a replica announces at its first publication: ``peer`` publishes two blocks of its
    own; ``replica`` asks every second, from its steps)."""
    lt.run(peer.generate([tokens(seed, 2 * BLOCK + 1)], max_tokens=1))
    deadline = time.monotonic() + 60
    while lt.run(replica.counters()).get("host_index_peers", 0) < 1:
        assert time.monotonic() < deadline, "the scheduler never mapped its peer's host index"
        lt.run(replica.generate([tokens(seed + 1, 20)], max_tokens=1))
        time.sleep(0.5)


def test_a_prefix_no_other_replica_held_is_not_saved_by_default(churn_pair: World):
    """``xavier_save_victims`` shared (the default): A hands out the blocks of a prefix that
    only A ever held (and of the prompts that push it out): none is saved, each counted;
    B asking later recomputes the prefix, tokens equal."""
    lt, r = churn_pair.pair
    a, b = r.replicas
    _until_mapped(lt, a, b, 5)
    prefix = tokens(81, PREFIX)
    asked = prefix + tokens(82, TAIL)
    base = lt.run(a.generate([asked], xavier=False))[0]["ids"]
    lt.run(a.reset_prefix_cache())  # (B never held any of it)
    lt.run(a.generate([prefix + tokens(83, TAIL)]))
    lt.run(a.flush())
    before_a = lt.run(a.counters())
    _churn(lt, a, 300)
    lt.run(a.flush())
    ca = delta(before_a, lt.run(a.counters()))
    assert ca["in_place_reused"] >= PREFIX // BLOCK
    assert ca.get("in_place_victims", 0) == 0 and ca.get("export_exported", 0) == 0
    assert ca["in_place_victims_never_shared"] >= PREFIX // BLOCK
    before = lt.run(b.counters())
    out = lt.run(b.generate([asked]))[0]
    cb = delta(before, lt.run(b.counters()))
    assert out["cached"] == 0 and cb.get("blocks_written", 0) == 0 and out["ids"] == base
    assert leases_settled(lt, r) == 0


def test_victim_saves_dropped_at_runtime_are_named_but_never_copied(churn_pair: World):
    """``XavierEngine.set_victim_saves(False)`` (the benchmark's measure of what saves cost):
    A, the last holder of a loaded prefix, hands it out with its saves dropped: the victims
    are named (counted) but nothing is copied or registered, so B, asking later, recomputes
    it, tokens equal.  Saves on again: the next test (file order, one worker) needs them."""
    lt, r = churn_pair.pair
    a, b = r.replicas
    prefix, asked, base = _published_prefix(lt, b, b, 91)
    assert lt.run(a.generate([prefix + tokens(94, TAIL)]))[0]["cached"] == PREFIX
    lt.run(a.flush())
    _until_mapped(lt, b, a, 12)
    _churn(lt, b, 600)  # B hands its copy out first (A holds it: B saves none)
    lt.run(b.flush())
    lt.run(a.set_victim_saves(False))
    try:
        before_a = lt.run(a.counters())
        _churn(lt, a, 700)
        lt.run(a.flush())
        ca = delta(before_a, lt.run(a.counters()))
    finally:
        lt.run(a.set_victim_saves(True))
    assert ca["in_place_victims"] >= PREFIX // BLOCK  # named by A's scheduler ...
    assert ca.get("export_exported", 0) == 0 == ca.get("export_published", 0)  # ... not copied
    before = lt.run(b.counters())
    out = lt.run(b.generate([asked]))[0]
    cb = delta(before, lt.run(b.counters()))
    assert out["cached"] == 0 and cb.get("blocks_written", 0) == 0 and out["ids"] == base
    assert leases_settled(lt, r) == 0


def test_a_loaded_prefix_is_saved_into_xaviers_tier_by_its_last_holder(churn_pair: World):
    """B computes a prefix, A loads it (A holds it, loaded: shown shared).  B hands its copy
    out first and saves none (A holds it then: counted); A hands its copy out last and saves
    it into its Xavier tier before anything wrote it.  B then loads the prefix from A's
    tier, bit-exact, tokens equal; those reads are of Xavier's own tier: B's scheduler
    leased each with the step that loaded it and released them all when vLLM reported the
    load done."""
    lt, r = churn_pair.pair
    a, b = r.replicas
    prefix, asked, base = _published_prefix(lt, b, b, 71)
    out = lt.run(a.generate([prefix + tokens(74, TAIL)]))[0]
    assert out["cached"] == PREFIX  # A loaded it from B's vLLM cache
    lt.run(a.flush())
    _until_mapped(lt, b, a, 6)
    _until_mapped(lt, a, b, 8)
    before_b = lt.run(b.counters())
    _churn(lt, b, 400)
    lt.run(b.flush())
    cb = delta(before_b, lt.run(b.counters()))
    assert cb["in_place_victims_held_elsewhere"] >= PREFIX // BLOCK
    assert cb.get("in_place_victims", 0) == 0
    before_a = lt.run(a.counters())
    _churn(lt, a, 500)
    lt.run(a.flush())
    ca = delta(before_a, lt.run(a.counters()))
    assert ca["in_place_victims"] >= PREFIX // BLOCK and ca["export_published"] >= PREFIX // BLOCK
    assert ca["in_place_victims_never_shared"] > 0  # (the churn's own prompts)
    before = lt.run(b.counters())
    out = lt.run(b.generate([asked]))[0]
    cb = delta(before, lt.run(b.counters()))
    assert out["cached"] == PREFIX and cb["blocks_written"] == PREFIX // BLOCK
    assert cb.get("rows_from_vllm_cache", 0) == 0  # A's cache no longer holds them
    assert cb["rows_from_cpu_tier"] + cb.get("rows_from_gpu_tier", 0) == PREFIX // BLOCK
    assert cb["validation_failures"] == 0 and out["ids"] == base
    assert_loaded_bytes_exact(lt, r, PREFIX // BLOCK)
    assert cb["leases_asked"] == PREFIX // BLOCK
    assert leases_settled(lt, r) == 0


def test_a_loader_holds_what_it_loaded_so_the_source_saves_no_second_copy(prefix_on_a):
    """B loads A's prefix and publishes it in place too (it holds it now); A then hands its
    copies out and saves none of them (a peer of the host holds them: counted), and A asks
    for the prompt again: it loads it from B's vLLM cache (the prefix B loaded and the
    blocks B computed after it), tokens equal, leases back."""
    world, asked, base = prefix_on_a
    lt, r = world.pair
    a, b = r.replicas
    before_b = lt.run(b.counters())
    out = lt.run(b.generate([asked]))[0]
    lt.run(b.flush())
    cb = delta(before_b, lt.run(b.counters()))
    assert out["cached"] == PREFIX and cb["rows_from_vllm_cache"] == PREFIX // BLOCK
    assert out["ids"] == base
    # the loaded blocks and the tail's full blocks: B publishes what it holds
    assert cb["in_place_registered"] == cb["in_place_published"] >= (PREFIX + TAIL) // BLOCK
    _until_mapped(lt, a, b, 10)
    before_a = lt.run(a.counters())
    _churn(lt, a, 500)
    lt.run(a.flush())
    ca = delta(before_a, lt.run(a.counters()))
    assert ca["in_place_reused"] >= PREFIX // BLOCK
    assert ca["in_place_victims_held_elsewhere"] >= PREFIX // BLOCK
    before_a = lt.run(a.counters())
    again = lt.run(a.generate([asked]))[0]
    ca = delta(before_a, lt.run(a.counters()))
    full = (PREFIX + TAIL) // BLOCK  # B computed the tail's full blocks: it holds them too
    assert again["cached"] == full * BLOCK and again["ids"] == base
    assert ca["rows_from_vllm_cache"] == full and ca["validation_failures"] == 0
    assert ca.get("rows_from_gpu_tier", 0) + ca.get("rows_from_cpu_tier", 0) == 0
    assert leases_settled(lt, r) == 0


def test_the_quiet_spell_is_set_at_runtime_on_every_worker(churn_pair: World):
    """``XavierEngine.set_quiet_ms`` (the benchmark's ``batched-quiet0`` on the same warm
    engines) reaches every worker's quiet gate: a spell out of range is refused naming
    ``xavier_quiet_ms`` and changes nothing; 0 turns the gate off (a hit still loads, its
    tokens equal, nothing deferred); another spell sets its deadline to 4 spells.  (What
    the gate holds back: ``test_storage_writer.py`` and ``test_publisher.py``.)"""
    lt, r = churn_pair.pair
    a, b = r.replicas
    default = (DEFAULT_QUIET_MS / 1000, MAX_DEFER_QUIETS * DEFAULT_QUIET_MS / 1000)
    assert lt.run(a.hook_all("quiet_spell")) == [pytest.approx(default)]
    with pytest.raises(ValueError, match="xavier_quiet_ms"):
        lt.run(a.set_quiet_ms(1001))
    assert lt.run(a.hook_all("quiet_spell")) == [pytest.approx(default)]
    try:
        lt.run(a.set_quiet_ms(0))
        assert lt.run(a.hook_all("quiet_spell")) == [pytest.approx((0.0, 0.0))]
        prefix, asked, base = _published_prefix(lt, b, a, 111)
        before = lt.run(a.counters())
        out = lt.run(a.generate([asked]))[0]
        assert out["cached"] == PREFIX and out["ids"] == base
        lt.run(a.flush())
        assert delta(before, lt.run(a.counters())).get("background_deferrals", 0) == 0
        lt.run(a.set_quiet_ms(250))
        assert lt.run(a.hook_all("quiet_spell")) == [pytest.approx((0.25, 1.0))]
    finally:
        lt.run(a.set_quiet_ms(DEFAULT_QUIET_MS))
    assert lt.run(a.hook_all("quiet_spell")) == [pytest.approx(default)]
    assert leases_settled(lt, r) == 0
