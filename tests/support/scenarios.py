"""The end-to-end scenarios every real-engine suite runs, written once: the no-sharing
baseline, a cross-replica hit, the negative control (copy skipped) and a failed block.

A new model or configuration is then a few lines: a world (``tests/support/worlds.py``)
and one call per scenario, plus the assertions that are that configuration's own.

Baselines run on replica A with sharing off for the request (``kv_transfer_params=
{"xavier": False}``: no query, no export).  GPU kernels give bit-identical results only for
identical computation shapes, so the baseline is computed the way B's run is: A first serves
the priming prompts with sharing off (computing the shared prefix exactly as its later
export will), then the asked prompts, whose prefix is then a *local* hit on A.  Then A's
prefix cache is reset and A serves the priming prompts again with sharing on, computing and
exporting every block.  Prompts of a scenario come from one ``seed``: the shared prefix is
``tokens(seed, prefix)``, A's priming tail ``tokens(seed + 1, tail)``, B's asked tail
``tokens(seed + 2, tail)``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from xinference.model.llm.vllm.xavier.planning.counters import GAUGE_NAMES

from .loop_thread import LoopThread
from .processes import tokens
from .xavier_replicas import Replicas


def delta(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
    """Counters that changed from ``before`` to ``after`` (every name of ``after``; a level,
    e.g. the cost model's estimates, as it is ``after``)."""
    return {k: after[k] if k in GAUGE_NAMES else after[k] - before.get(k, 0) for k in after}


def leases(lt: LoopThread, r: Replicas) -> int:
    """Leases the directory holds now (0 after every finished load)."""
    return int(lt.run(r.tracker.stats())["outstanding_leases"])


def leases_settled(lt: LoopThread, r: Replicas, timeout: float = 10.0) -> int:
    """Leases the directory holds once the releases on their way arrived: the scheduler
    half sends a load's releases when vLLM reports the load done, without waiting; polls
    until 0 or ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        held = leases(lt, r)
        if held == 0 or time.monotonic() > end:
            return held
        time.sleep(0.1)


def baseline_then_prime(lt: LoopThread, r: Replicas, asked: List[List[int]],
                        prime: List[List[int]], local_hit: int) -> List[List[int]]:
    """Tokens of ``asked`` on A without sharing, their first ``local_hit`` tokens a local
    prefix-cache hit left by ``prime``; then A, its cache reset, serves ``prime`` with
    sharing on."""
    a, b = r.replicas[:2]
    lt.run(b.reset_recent_loads())
    lt.run(a.reset_prefix_cache())
    lt.run(a.generate(prime, xavier=False))
    base = lt.run(a.generate(asked, xavier=False))
    assert all(x["cached"] == local_hit for x in base)
    lt.run(a.reset_prefix_cache())
    lt.run(a.generate(prime))
    return [x["ids"] for x in base]


@dataclass
class Scenario:
    """One shared prefix: what B asks for and what A computed without sharing."""

    asked: List[int]
    base: List[int]


def primed(lt: LoopThread, r: Replicas, seed: int, prefix: int, tail: int = 40) -> Scenario:
    """The baseline of B's prompt (seed's prefix + its asked tail), and A's export of the
    prefix (see the module)."""
    shared = tokens(seed, prefix)
    asked = shared + tokens(seed + 2, tail)
    base = baseline_then_prime(lt, r, [asked], [shared + tokens(seed + 1, tail)],
                               local_hit=prefix)
    return Scenario(asked, base[0])


@dataclass
class Hit:
    """B's request after A exported the prefix: its record (``ids``, ``cached``, TTFT) and
    B's counters for it."""

    scenario: Scenario
    out: Dict[str, Any]
    counters: Dict[str, int]


def cross_replica_hit(lt: LoopThread, r: Replicas, seed: int, prefix: int,
                      tail: int = 40) -> Hit:
    """A computes and exports a ``prefix``-token prefix, B asks for it: B's tokens equal the
    baseline and all of the prefix came from A (B had none of it locally)."""
    s = primed(lt, r, seed, prefix, tail)
    b = r.replicas[1]
    before = lt.run(b.counters())
    out = lt.run(b.generate([s.asked]))[0]
    hit = Hit(s, out, delta(before, lt.run(b.counters())))
    assert out["ids"] == s.base
    assert out["cached"] == prefix
    return hit


def negative_control(lt: LoopThread, r: Replicas, seed: int, prefix: int, tail: int = 40,
                     tp_rank: Optional[int] = None) -> None:
    """The hit of :func:`cross_replica_hit`, but B's copies are skipped while the load
    claims success (on worker ``tp_rank`` only, when given): the hit is claimed and the
    tokens differ from the baseline, so the same checks catch a missing copy."""
    s = primed(lt, r, seed, prefix, tail)
    b = r.replicas[1]
    if tp_rank is None:
        lt.run(b.inject_fault("skip_copy"))
    else:
        lt.run(b.hook_all("inject_fault", "skip_copy", 1, tp_rank))
    out = lt.run(b.generate([s.asked]))[0]
    assert out["cached"] == prefix  # the hit was claimed ...
    assert out["ids"] != s.base  # ... and the missing copy is caught
    assert leases(lt, r) == 0


def assert_loaded_bytes_exact(lt: LoopThread, r: Replicas, keys_expected: int) -> None:
    """Every block B's recent loads wrote holds exactly A's stored bytes of that block."""
    a, b = r.replicas[:2]
    loaded = lt.run(b.loaded_block_digests())
    stored = lt.run(a.stored_block_digests(list(loaded)))
    assert len(loaded) >= keys_expected
    assert stored == loaded


def serve_with_one_failed_block(lt: LoopThread, r: Replicas, asked: List[int],
                                blocks: int) -> List[int]:
    """B serves ``asked`` (a ``blocks``-block hit) with one loaded block zeroed and reported
    failed: vLLM recomputes it and nothing computed against it is published.  B's tokens."""
    b = r.replicas[1]
    before = lt.run(b.counters())
    lt.run(b.inject_fault("fail_one_block"))  # the middle block is zeroed and reported failed
    out = lt.run(b.generate([asked]))
    c = delta(before, lt.run(b.counters()))
    assert c["faults_fail_one_block"] == 1
    assert c["blocks_written"] == blocks - 1
    [(group, block)] = lt.run(b.recorded_faults())
    # vLLM recomputed from the failed block: it no longer holds the zeros the fault left
    assert not lt.run(b.engine_block_is_zero(group, block))
    # what the failed step computed against the zeroed block was never published: every
    # block B stored equals the (recomputed) engine block it came from
    assert lt.run(b.stored_vs_engine_mismatches()) == []
    assert leases(lt, r) == 0
    return out[0]["ids"]


def block_names_of(seed: str, ids: Sequence[int], block: int = 16) -> List[int]:
    """Xavier's names of the full blocks of ``ids`` as an engine whose ``NONE_HASH`` comes
    from ``seed`` hashes them (vLLM's sha256 chain, no extra keys)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens

    from xinference.model.llm.vllm.xavier.planning.block_names import block_name

    fn = get_hash_fn_by_name("sha256")
    parent, names = BlockHash(fn(seed)), []
    for i in range(len(ids) // block):
        parent = hash_block_tokens(fn, parent, list(ids[i * block:(i + 1) * block]))
        names.append(block_name(parent))
    return names


_FRESH = itertools.count(90_000)  # seeds of prompts no test asked before


def until_whole_launch(lt: LoopThread, replica: Any, value: int, what: str) -> None:
    """Let ``replica`` serve small new prompts (its steps poll the directory, and each
    publishes a block) until its gauge ``host_index_whole_launch`` reads ``value``."""
    deadline = time.monotonic() + 60
    while lt.run(replica.counters()).get("host_index_whole_launch", 0) != value:
        assert time.monotonic() < deadline, what
        lt.run(replica.generate([tokens(next(_FRESH), 40)]))
        time.sleep(0.3)
    lt.run(replica.generate([tokens(next(_FRESH), 40)]))  # (a publication after the switch)
    lt.run(replica.flush())
