"""Two real vLLM replicas behind a round-robin router, with and without Xavier.

    python benchmarks/serving_bench.py [--quick] [--device cpu|cuda] [--concurrency 1,8,16,32]
        [--prefix-tokens 1024,4096] [--modes plain,local-hit,none,per_request,batched]
        [--unique] [--model DIR] [--gpus 0,1] [--tp 2] [--eager] [--cpu-bind replica|auto]

Workload: groups of requests share a long prefix (a system prompt or a conversation's
history) and differ in a short suffix; the turns of a group alternate between the two
replicas, so a group's follow-up lands on the replica that did *not* compute its prefix.
Output length is fixed (``ignore_eos``).  Modes:

* ``plain``: what users have without Xavier: two replicas of vLLM's own ``AsyncLLM``, no KV
  connector, vLLM's defaults (a second engine pair, in the same run);
* ``noop-connector`` (only when asked): plain replicas with a KV connector that does nothing
  (``tests/support/noop_connector.py``): what vLLM's own connector machinery costs, with no
  Xavier code in the engine (a third engine pair);
* ``local-hit``: the plain replicas, each group's follow-up sent to the replica that
  computed its prefix (a local prefix-cache hit): the floor for any cross-replica hit;
* ``none``: Xavier's replicas, sharing off (requests opt out:
  ``kv_transfer_params={"xavier": False}``), each replica only has its local prefix cache;
* ``none-local-hit``: ``local-hit`` on Xavier's replicas with sharing off (the floor within
  the same engines: for a short device visit with ``--check-groups 0``, no plain pair);
* ``batched``: Xavier, one load call per scheduler step;
* ``per_request``: Xavier, one load call per request (the baseline; switched on the same
  warm engines with ``XavierEngine.set_batched_loads(False)``, as ``XAVIER_BATCHED_LOADS=0``
  would at launch).
* ``vllm-offload-fs`` (GPU only: vLLM's offloading runs on CUDA, ROCm and XPU): what a vLLM
  user would pick instead of Xavier, vLLM's own tiered offloading: two plain replicas with
  vLLM's ``OffloadingConnector`` (``TieringOffloadingSpec``: a CPU primary tier of
  ``--peer-cpu-bytes``, default Xavier's GPU + CPU budgets together, and an ``fs`` secondary
  tier under ``--peer-fs-dir``, one directory for both replicas, so that a block one replica
  stored is found by the other), the same ``PYTHONHASHSEED`` on both (vLLM's block hashes);
  routed as the Xavier rows (a group's follow-up on the other replica).

Every row's answers are checked: after the measured rows, a sample of each row's prompts
(the follow-up turns of the first ``--check-groups`` groups) is generated again on the
plain replicas one at a time, and the row reports ``tokens_equal_plain`` (how many of the
sampled requests produced the same tokens): a fast wrong peer cannot win.  With
``--check-groups 0`` and no plain mode asked, no plain pair starts and nothing is checked
(a timing experiment on a short device visit; its rows say so: no ``tokens_equal_plain``).
The plain rows' own figure is the noise floor (vLLM's batch-dependent arithmetic).

``--chat 32,96`` adds rows of a multi-turn chat (issue #34) for ``plain``, ``local-hit``,
``none``, ``batched`` and ``vllm-offload-fs`` (those asked for; the peer's ``ext hit`` is
not counted: what it loaded is in the cached share): that many users of one assistant, a system
prompt all share (``--chat-shape TURNS,SYSTEM,MESSAGE``, default 4 turns, 1024 and 768
tokens), each user in a closed loop whose next prompt is its whole history (earlier
messages and the engine's answers) plus a new message, every request routed round robin
over the two replicas (``local-hit``: each user stays on one).  The row's follow-ups are
the later turns; ``conc`` is the number of users, ``prefix`` the system prompt.

``--unique`` adds rows of a workload with no shareable prefix (every prompt distinct),
for ``plain``, ``batched`` (and ``noop-connector`` / ``none`` / ``batched-dropsaves`` /
``batched-quiet0`` / ``batched-dirpub`` when asked): what Xavier costs when there is
nothing to share.

GPU runs use CUDA graphs (vLLM's default); ``--eager`` turns them off.

Every mode uses fresh prefixes, so no mode profits from another's exports.  A short
unmeasured warm-up (both replicas, sharing on) runs first after the engines start: it maps
the peers' storages and compiles kernels, one-time costs that are not per request.  Reported per
(mode, concurrency, prefix length): output tokens/s, TTFT p50/p95 (measured next to each
engine), the same two for the follow-up turns alone (the requests that land on the replica
that did not compute their prefix: a cross-replica load with Xavier, a full recompute
without), the external hit rate (tokens loaded from the other replica / prompt tokens), load
calls per request, and each replica's counters.  Writes JSON under ``doc/results/``.

``--shape qwen2.5-0.5b`` builds a random-weight bf16 model with Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864; a small local vocabulary)
for the GPU runs.

``--shape qwen2.5-7b``: Qwen2.5-7B's shape (hidden 3584, 28 layers, 28 heads, 4 KV heads,
intermediate 18944) with vLLM's own random weights (``load_format="dummy"``, the same in
every engine): no weight file to write.

The JSON's ``device_memory`` (GPU runs) holds each worker's device memory as torch's
allocator counts it and, per Xavier replica, ``adds_bytes``: the GPU memory Xavier adds
beyond vLLM's own (its peak reserved minus the plain replicas', same KV cache).

``--gpus 0,1`` (with ``--device cuda``) puts each replica on its own GPU, given to its sub
pool as ``CUDA_VISIBLE_DEVICES`` as Xinference does: loads then cross GPUs through CUDA
IPC.  Without it both replicas share the one GPU (started one after the other).

``--tp 2``: every replica (plain ones too) is tensor parallel over two workers (vLLM's
multiprocessing executor): on CUDA each replica on GPUs 0 and 1 (the pairs started one after
the other); on CPU one OpenMP core per worker (``VLLM_CPU_OMP_THREADS_BIND``).

On CPU each replica of every pair runs its forwards on cores of its own
(``VLLM_CPU_OMP_THREADS_BIND``: the physical cores split evenly, ``replica_cores``; a
binding the user exported is kept; ``--tp 2`` binds worker k of each replica to core k,
whatever ``--cpu-bind``); ``--cpu-bind auto`` keeps vLLM's binding, which gives every
engine of the host the same cores, so that a pair whose connector makes vLLM reserve a
core more spreads over more cores than a plain pair.

``--steady-state`` fills every replica's top storage tier before measuring (unmeasured
requests with fresh prefixes, each asked on both replicas, until each replica has evicted;
before session 31 each fill prefix was asked once), so that every Xavier row meets
a full tier, as a long-running deployment does; ``--gpu-budget`` / ``--cpu-budget`` size the
tiers (a smaller GPU tier fills sooner).  Without it, rows after the tier fills pay for
evictions the earlier rows did not (see doc/benchmarks.md, "Two GPUs").

``--quick`` (the README's main job): the tiny local model on CPU, prefix 512, concurrency 8,
modes ``plain``, ``noop-connector``, ``none`` and ``batched``, and the unique-prompt rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.support.engines import EngineOptions, replica_cores  # noqa: E402
from tests.support.scenarios import delta as counter_delta  # noqa: E402
from tests.support.tiny_model import TinyQwen2, build_qwen2_config_only, build_tiny_qwen2  # noqa: E402
from tests.support.xavier_replicas import Replicas, xavier_replicas  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.trace_spans import ENV_STEP_TRACE  # noqa: E402

BLOCK = 16
SHAPES = {
    "tiny": TinyQwen2(),
    # Qwen2.5-0.5B's transformer (random weights, bf16); a small local vocabulary
    "qwen2.5-0.5b": TinyQwen2(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                              max_positions=32768),
    # Qwen2.5-7B's transformer (issue #33's 7B rows): vLLM draws its weights
    # (``load_format="dummy"``), 15 GB of bf16 would take minutes to write
    "qwen2.5-7b": TinyQwen2(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944,
                            max_positions=40960),
}
#: shapes built without a weight file: vLLM's dummy weights (same seed in every engine)
DUMMY_WEIGHT_SHAPES = ("qwen2.5-7b",)


def workload(seed: int, groups: int, per_group: int, prefix: int, suffix: int,
             vocab: int) -> List[List[int]]:
    """``groups * per_group`` prompts, ordered so consecutive requests of a group alternate
    replicas under round-robin."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(prefix)] for _ in range(groups)]
    prompts = []
    for _turn in range(per_group):
        for g in range(groups):
            prompts.append(prefixes[g] + [rng.randrange(10, vocab) for _ in range(suffix)])
    return prompts


@dataclasses.dataclass(frozen=True)
class ChatWorkload:
    """Users of one assistant (issue #34's ``chat`` rows): a system prompt every user
    shares, then per user ``turns`` messages of ``message`` tokens; each turn's prompt is
    the system prompt, the user's whole history (earlier messages and the answers the
    engine gave) and the new message."""

    system: Tuple[int, ...]
    messages: Tuple[Tuple[Tuple[int, ...], ...], ...]  # [user][turn]

    @property
    def users(self) -> int:
        return len(self.messages)

    @property
    def turns(self) -> int:
        return len(self.messages[0]) if self.messages else 0


def chat_workload(seed: int, users: int, turns: int, system: int, message: int,
                  vocab: int) -> ChatWorkload:
    rng = random.Random(seed)

    def text(n: int) -> Tuple[int, ...]:
        return tuple(rng.randrange(10, vocab) for _ in range(n))

    return ChatWorkload(text(system), tuple(tuple(text(message) for _ in range(turns))
                                            for _ in range(users)))


async def run_chat(r: Replicas, chat: ChatWorkload, max_tokens: int, xavier: bool,
                   sticky: bool = False) -> Tuple[Dict[str, Any], List[List[int]]]:
    """Every user in a closed loop (the next turn leaves when the answer came back), all
    users at once; a router sends each request to the next replica in turn (round robin
    over all requests), so a user's next turn lands on either replica; ``sticky``: each
    user always on one replica (the local-hit floor).  Returns the row (the later turns are
    its follow-ups) and the prompts sent, indexed ``turn * users + user``."""
    before = [await x.counters() for x in r.replicas]
    n = chat.users * chat.turns
    prompts: List[List[int]] = [[] for _ in range(n)]
    results: List[Optional[Dict[str, Any]]] = [None] * n
    rr = itertools.count()

    async def user(u: int) -> None:
        history = list(chat.system)
        for t in range(chat.turns):
            i = t * chat.users + u
            prompts[i] = history + list(chat.messages[u][t])
            replica = r.replicas[(u if sticky else next(rr)) % len(r.replicas)]
            out = (await replica.generate([prompts[i]], max_tokens=max_tokens,
                                          xavier=xavier))[0]
            results[i] = out
            history = prompts[i] + list(out["ids"])

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(chat.users)))
    wall = time.perf_counter() - t0
    after = [await x.counters() for x in r.replicas]
    done = [x for x in results if x is not None]
    later = [x for x in results[chat.users:] if x is not None]
    ttft = sorted(x["ttft_s"] for x in done if x["ttft_s"] is not None)
    later_ttft = sorted(x["ttft_s"] for x in later if x["ttft_s"] is not None)
    delta = [counter_delta(b, a) for a, b in zip(after, before)]  # levels as they are now
    prompt_tokens = sum(len(p) for p in prompts)
    calls = sum(d.get("batch_calls", 0) for d in delta)
    nan = float("nan")
    row = {
        "requests": len(done), "wall_s": wall, "users": chat.users, "turns": chat.turns,
        "output_tokens_per_s": sum(len(x["ids"]) for x in done) / wall,
        "ttft_p50_ms": 1000 * _pct(ttft, 50), "ttft_p95_ms": 1000 * _pct(ttft, 95),
        # the later turns: a history the user built, on whichever replica the router picked
        "followup_tokens_per_s": nan,
        "followup_ttft_p50_ms": 1000 * _pct(later_ttft, 50),
        "followup_ttft_p95_ms": 1000 * _pct(later_ttft, 95),
        "external_hit_rate": sum(d.get("hit_tokens", 0) for d in delta) / prompt_tokens,
        "local_or_external_cached_rate": sum(x["cached"] for x in done) / prompt_tokens,
        "load_calls": calls, "load_calls_per_request": calls / max(1, len(done)),
        "load_launch_us_per_call": sum(d.get("load_launch_us", 0) for d in delta)
        / max(1, calls),
        "export_launch_share": sum(d.get("export_launch_us", 0) for d in delta) / 1e6
        / (2 * wall),
        "counters": delta,
        "_ids": [None if x is None else x["ids"] for x in results],
    }
    return row, prompts


def unique_workload(seed: int, n: int, length: int, vocab: int) -> List[List[int]]:
    """``n`` prompts of ``length`` tokens that share no block."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


async def run_mode(r: Replicas, prompts: Sequence[List[int]], groups: int, concurrency: int,
                   max_tokens: int, xavier: bool, sticky: bool = False) -> Dict[str, Any]:
    """Send ``prompts`` (turn-major: ``groups`` prompts per turn) with at most
    ``concurrency`` in flight.  Routing alternates each group between the replicas turn by
    turn, so every follow-up turn lands on the replica that did not serve the one before;
    ``sticky``: a group always goes to the same replica (local hits)."""
    sem = asyncio.Semaphore(concurrency)
    before = [await x.counters() for x in r.replicas]
    results: List[Optional[Dict[str, Any]]] = [None] * len(prompts)

    async def one(i: int) -> None:
        turn, group = divmod(i, groups)
        async with sem:
            replica = r.replicas[(group if sticky else turn + group) % len(r.replicas)]
            out = await replica.generate([prompts[i]], max_tokens=max_tokens, xavier=xavier)
            results[i] = out[0]

    t0 = time.perf_counter()
    turn_walls = []
    for start in range(0, len(prompts), groups):  # a turn starts when the previous ended
        t_turn = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(start, min(start + groups,
                                                                len(prompts)))))
        turn_walls.append(time.perf_counter() - t_turn)
    wall = time.perf_counter() - t0
    after = [await x.counters() for x in r.replicas]
    done = [x for x in results if x is not None]
    ttft = sorted(x["ttft_s"] for x in done if x["ttft_s"] is not None)
    follow = [x for i, x in enumerate(results) if x is not None and i >= groups]
    followup_cached = sum(x["cached"] for x in follow)
    follow_ttft = sorted(x["ttft_s"] for x in follow if x["ttft_s"] is not None)
    follow_wall = sum(turn_walls[1:])
    delta = [counter_delta(b, a) for a, b in zip(after, before)]  # levels as they are now
    hit_tokens = sum(d.get("hit_tokens", 0) for d in delta)
    prompt_tokens = sum(len(p) for p in prompts)
    calls = sum(d.get("batch_calls", 0) for d in delta)
    steps = sum(d.get("scheduler_steps", 0) for d in delta)
    worker_us = {k: sum(d.get(k, 0) for d in delta) for k in (
        "load_launch_us", "load_launch_cpu_us", "export_launch_us", "scheduler_us",
        "lookup_wait_us", "peer_map_us", "hit_lookup_us", "hit_load_wait_us")}
    lookups = sum(d.get("lookup_calls", 0) for d in delta)
    started = sum(d.get("hits_started", 0) for d in delta)
    return {
        # misses answered without a lookup (the whole launch on this host, no index naming
        # the first block) against the directory lookups made
        "lookup_calls": lookups,
        "lookups_skipped_held_nowhere": sum(d.get("lookups_skipped_held_nowhere", 0)
                                            for d in delta),
        "load_launch_us_per_call": worker_us["load_launch_us"] / max(1, calls),
        # the launch thread's CPU time: wall minus this is waiting (GIL, locks, driver)
        "load_launch_cpu_us_per_call": worker_us["load_launch_cpu_us"] / max(1, calls),
        "load_launch_max_us": max((a.get("load_launch_max_us", 0) for a in after), default=0),
        "peer_map_us": worker_us["peer_map_us"],
        "lookup_wait_us_per_lookup": worker_us["lookup_wait_us"] / max(1, lookups),
        # a hit's time before its first forward: arrival -> answer, allocation -> forward
        "hit_lookup_us_per_hit": worker_us["hit_lookup_us"] / max(1, started),
        "hit_load_wait_us_per_hit": worker_us["hit_load_wait_us"] / max(1, started),
        # the host time a step spends in Xavier, over the run's wall time (both replicas)
        "export_launch_share": worker_us["export_launch_us"] / 1e6 / (2 * wall),
        "load_launch_share": worker_us["load_launch_us"] / 1e6 / (2 * wall),
        "scheduler_us_per_step": worker_us["scheduler_us"] / max(1, steps),
        "lookup_wait_us_per_step": worker_us["lookup_wait_us"] / max(1, steps),
        "requests": len(done), "wall_s": wall,
        "output_tokens_per_s": sum(len(x["ids"]) for x in done) / wall,
        "ttft_p50_ms": 1000 * _pct(ttft, 50), "ttft_p95_ms": 1000 * _pct(ttft, 95),
        "followup_tokens_per_s": (sum(len(x["ids"]) for x in follow) / follow_wall
                                  if follow_wall else float("nan")),
        "followup_ttft_p50_ms": 1000 * _pct(follow_ttft, 50),
        "followup_ttft_p95_ms": 1000 * _pct(follow_ttft, 95),
        "external_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "followup_cached_tokens": followup_cached,
        "local_or_external_cached_rate": sum(x["cached"] for x in done) / prompt_tokens,
        "load_calls": calls, "load_calls_per_request": calls / max(1, len(done)),
        "counters": delta,
        # every request's tokens, by prompt index (checked against plain vLLM, then dropped)
        "_ids": [None if x is None else x["ids"] for x in results],
    }


def _pct(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


PLAIN_MODES = ("plain", "local-hit", "noop-connector")
#: each group's follow-up on the replica that computed its prefix (a local hit)
STICKY_MODES = ("local-hit", "none-local-hit")
#: vLLM's own KV sharing, each on a pair of its own (plain vLLM with vLLM's connector)
PEER_MODES = ("vllm-offload-fs",)
#: Xavier copying every computed block into its own tiers (``xavier_in_place`` off: the
#: design before #33), on a second Xavier pair beside the default one
COPY_MODE = "batched-copy"
#: Xavier reading vLLM's cache in place but saving none of the published blocks vLLM hands
#: out again (``xavier_save_victims`` off: its tiers stay empty), on a pair of its own
NOSAVE_MODE = "batched-nosave"
#: ... saving every one of them that no same-host peer holds (``xavier_save_victims`` all;
#: the default saves only those shown to be shared)
SAVEALL_MODE = "batched-saveall"
#: ``batched`` on the default pair with the workers dropping every victim save
#: (``XavierEngine.set_victim_saves``: the scheduler still names the victims, nothing is
#: copied or registered): what saves cost, measured on the same warm engines as ``batched``
DROPSAVES_MODE = "batched-dropsaves"
#: ... moving the CPU tier's bytes with the copy engine only (``XAVIER_UVA=0``: demotions
#: gather on the GPU, then one transfer into page-locked memory and a host scatter; the
#: default writes the mapped CPU tier from the fused kernel's thread blocks)
UVA0_MODE = "batched-uva0"
#: ... with vLLM's engine processes at Python's GIL switch interval of 100 µs (default 500)
GIL100_MODE = "batched-gil100"
#: ... with the room thread's demotions into the CPU tier from the fused kernel's full grid
#: (``XAVIER_ROOM_COPY_PROGRAMS=0``, as before session 37; the default uses 4 thread blocks)
ROOMWIDE_MODE = "batched-roomwide"
#: ... with every block published in place registered in the directory too, though the
#: whole launch is on this host (``XAVIER_LOCAL_PUBLISH=0``, as before session 39)
DIRPUB_MODE = "batched-dirpub"
#: ``batched`` on the default pair with the workers' background work (room rounds,
#: directory registrations) run at once instead of after a quiet spell
#: (``XavierEngine.set_quiet_ms(0)``, as before session 42), on the same warm engines
QUIET0_MODE = "batched-quiet0"
#: ``batched`` rows on the default pair with a runtime switch of its replicas: the call that
#: switches it, its value for the row, and its value after it (None: the value the call
#: returned, the replica's own before the row)
RUNTIME_SWITCHES: Dict[str, Tuple[str, Any, Any]] = {
    DROPSAVES_MODE: ("set_victim_saves", False, True),
    QUIET0_MODE: ("set_quiet_ms", 0, None)}
#: batched rows on Xavier pairs of their own, started with these environment settings
VARIANT_PAIRS: Dict[str, Dict[str, str]] = {COPY_MODE: {"XAVIER_IN_PLACE": "0"},
                                            NOSAVE_MODE: {"XAVIER_SAVE_VICTIMS": "off"},
                                            SAVEALL_MODE: {"XAVIER_SAVE_VICTIMS": "all"},
                                            UVA0_MODE: {"XAVIER_UVA": "0"},
                                            GIL100_MODE: {"XAVIER_SWITCH_INTERVAL_US": "100"},
                                            ROOMWIDE_MODE: {"XAVIER_ROOM_COPY_PROGRAMS": "0"},
                                            DIRPUB_MODE: {"XAVIER_LOCAL_PUBLISH": "0"}}


def offload_fs_config(cpu_bytes: int, fs_dir: str) -> Dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for tiered offloading: its ``OffloadingConnector`` with
    a CPU primary tier of ``cpu_bytes`` and an ``fs`` secondary tier in ``fs_dir`` (vLLM
    0.26/0.27: ``vllm/v1/kv_offload/tiering/spec.py``, ``tiering/fs/manager.py``; stores go
    through to the ``fs`` tier when the CPU store completes, lookups miss the CPU tier and
    then check the files)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": int(cpu_bytes),
                "secondary_tiers": [{"type": "fs", "root_dir": fs_dir}]}}


async def bench_modes(model: str, device: str, modes: Sequence[str],
                      concurrencies: Sequence[int], prefixes: Sequence[int], groups: int,
                      per_group: int, max_tokens: int, gpus: Optional[Sequence[str]] = None,
                      steady_state: bool = False, budgets: Optional[Dict[str, str]] = None,
                      eager: bool = False, unique: bool = False,
                      switch_interval_us: int = 0, tp: int = 1,
                      on_row: Callable[[List[Dict[str, Any]]], None] = lambda rows: None,
                      peer_cpu_bytes: int = 0, peer_fs_dir: str = "", check_groups: int = 8,
                      report: Optional[Dict[str, Any]] = None,
                      gpu_memory_utilization: Optional[float] = None,
                      dummy_weights: bool = False, chat_users: Sequence[int] = (),
                      chat_shape: Tuple[int, int, int] = (4, 1024, 768),
                      cpu_bind: str = "replica") -> List[Dict[str, Any]]:
    """Every mode in ONE run: the Xavier modes on one pair of warm engines, ``plain`` and
    ``local-hit`` on a pair of plain vLLM engines started beside them (not started with
    ``check_groups`` 0 and no plain mode asked); ``cpu_bind`` (CPU, one worker a replica):
    ``replica`` gives each replica of every pair its share of the cores (``replica_cores``),
    ``auto`` leaves vLLM's binding (both replicas of a pair on the same cores); rows interleaved per
    (prefix, concurrency), so that their ratios come from the same minutes.  ``on_row``
    sees the rows so far after each measurement (the JSON is rewritten then: a run cut
    short keeps what it measured).  ``report`` receives ``device_memory``
    (:func:`device_memory_report`) once the rows are measured."""
    rows: List[Dict[str, Any]] = []
    seed = 1000
    # the plain pair runs for its rows and the token check of every other row
    want_plain = check_groups > 0 or any(m in PLAIN_MODES for m in modes)
    want_noop = "noop-connector" in modes
    variants = [m for m in VARIANT_PAIRS if m in modes]
    want_xavier = any(m not in PLAIN_MODES + PEER_MODES + tuple(VARIANT_PAIRS)
                      for m in modes) or unique
    want_fs = "vllm-offload-fs" in modes
    if want_fs and device != "cuda":
        raise SystemExit("vllm-offload-fs: vLLM's offloading runs on CUDA, ROCm and XPU "
                         "only (vllm/v1/kv_offload/cpu/spec.py: get_worker)")
    turns, system, message = chat_shape
    chat_len = system + turns * (message + max_tokens) if chat_users else 0
    opts = EngineOptions(model=model, max_model_len=max(max(prefixes) + 512, chat_len + 64),
                         max_num_seqs=64)
    if tp > 1:  # every pair (plain too) of tensor-parallel replicas, vLLM's mp executor
        opts.extra.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        if device == "cuda":  # each replica on all TP GPUs (as Xinference places them)
            gpus = [",".join(str(i) for i in range(tp))] * 2
    kw: Dict[str, Any]
    if device == "cuda":
        # two pairs share the GPU when plain rows are asked for
        # (the plain pair counted even when not started: the same KV cache as a full run's)
        pairs_on_gpu = 1 + want_xavier + want_noop + want_fs + len(variants)
        util = {1: 0.3, 2: 0.2}.get(pairs_on_gpu, 0.13) if (not gpus or tp > 1) else 0.3
        util = gpu_memory_utilization or util
        if dummy_weights:
            opts.extra.update(load_format="dummy")
        opts.extra.update(attention_backend="TRITON_ATTN", gpu_memory_utilization=util,
                          max_num_batched_tokens=8192, enforce_eager=eager)
        # Xavier's own defaults (1 GiB GPU tier, 1 GiB CPU tier) unless asked otherwise
        kw = dict(gpu_budget="1GiB", cpu_budget="1GiB", sequential=gpus is None or tp > 1,
                  gpus=gpus)
    else:
        kw = dict(cpu_budget="512MiB")
    kw.update({k: v for k, v in (budgets or {}).items() if v})
    # the data plane's test hooks record every loaded and exported block (per-row Python on
    # each step): production has none, so neither do the measured replicas unless an
    # experiment needs them (--switch-interval-us)
    kw["extra_env"] = {} if switch_interval_us else {"XAVIER_TEST_HOOKS": ""}
    if tp > 1 and device == "cpu":  # vLLM's CPU build: one OpenMP core per TP worker
        kw["extra_env"]["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    elif device == "cpu" and cpu_bind == "replica":
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):  # (the user's binding, kept)
            print("[serving_bench] VLLM_CPU_OMP_THREADS_BIND is set: every replica keeps it",
                  flush=True)
        else:
            binds = kw["cpu_binds"] = replica_cores(2)
            shared = ": fewer cores than replicas, shared" if len(set(binds)) < 2 else ""
            print(f"[serving_bench] each replica's OpenMP threads on cores of its own "
                  f"(VLLM_CPU_OMP_THREADS_BIND {' / '.join(binds)}{shared})", flush=True)
    where = f"GPUs {','.join(gpus)}" if gpus else device
    vocab = 2000
    async with contextlib.AsyncExitStack() as stack:
        pairs: Dict[str, Replicas] = {}
        settings: Dict[str, Any] = {}
        # vLLM's offloading pair first: a configuration it refuses fails the run early
        for kind, wanted in (("vllm-offload-fs", want_fs), ("plain", want_plain),
                             ("noop", want_noop), ("xavier", want_xavier),
                             *((m, True) for m in variants)):
            if not wanted:
                continue
            print(f"[serving_bench] starting 2 {kind} replicas ({where})", flush=True)
            t0 = time.perf_counter()
            engine = opts
            pair_kw = dict(kw)
            if kind == "noop":
                engine = dataclasses.replace(opts, extra=dict(opts.extra, kv_transfer_config={
                    "kv_connector": "NoopConnector", "kv_role": "kv_both",
                    "kv_connector_module_path": "tests.support.noop_connector"}))
            if kind == "vllm-offload-fs":
                fs_dir = os.path.join(peer_fs_dir, f"run-{os.getpid()}-{int(time.time())}")
                os.makedirs(fs_dir, exist_ok=True)
                stack.callback(shutil.rmtree, fs_dir, True)
                transfer = offload_fs_config(peer_cpu_bytes, fs_dir)
                engine = dataclasses.replace(opts, extra=dict(opts.extra,
                                                              kv_transfer_config=transfer))
                # vLLM's block hashes start from a seed: random per engine unless
                # PYTHONHASHSEED is set (vllm/v1/core/kv_cache_utils.py: init_none_hash)
                pair_kw["extra_env"] = dict(kw["extra_env"], PYTHONHASHSEED="0")
                settings[kind] = transfer
            if kind in VARIANT_PAIRS:
                pair_kw["extra_env"] = dict(kw["extra_env"], **VARIANT_PAIRS[kind])
            if os.environ.get(ENV_STEP_TRACE):  # each pair's trace apart (their ranks repeat)
                pair_kw["extra_env"] = dict(pair_kw["extra_env"], **{
                    ENV_STEP_TRACE: os.path.join(os.environ[ENV_STEP_TRACE], kind)})
            pairs[kind] = await stack.enter_async_context(
                xavier_replicas(model, n=2, engine=engine,
                                plain=kind not in ("xavier", *VARIANT_PAIRS), **pair_kw))
            print(f"[serving_bench] {kind} replicas up in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        for kind in ("xavier", *variants):
            if kind not in pairs:
                continue
            for mode in ("per_request", "batched"):
                # warm-up, not measured: first peer mappings, kernel compilation, allocator growth
                await _set_mode(pairs[kind], mode)
                await run_mode(pairs[kind], workload(7 + len(mode), 2, 2, min(prefixes), 64,
                                                     vocab), 2, 2, max_tokens, xavier=True)
            if steady_state:
                saves = VARIANT_PAIRS.get(kind, {}).get("XAVIER_SAVE_VICTIMS") != "off"
                fill = await fill_tiers(pairs[kind], max(prefixes), vocab, saves=saves)
                settings[f"steady_state_fill_{kind}"] = fill
        for kind in ("plain", "vllm-offload-fs"):
            if kind in pairs:  # warm-up, not measured
                await run_mode(pairs[kind], workload(5, 2, 2, min(prefixes), 64, vocab), 2, 2,
                               max_tokens, xavier=True)
        checks: List[tuple] = []  # (row, prompts, groups): each row's token check, at the end

        async def measure(mode: str, prompts: List[List[int]], c: int, prefix: int,
                          work: str) -> None:
            r = pairs["noop" if mode == "noop-connector" else
                      "plain" if mode in PLAIN_MODES else
                      mode if mode in PEER_MODES + tuple(VARIANT_PAIRS) else "xavier"]
            if mode not in PLAIN_MODES + PEER_MODES:
                await _set_mode(r, "batched" if mode in (*VARIANT_PAIRS, *RUNTIME_SWITCHES)
                                else mode.split("-si")[0])
            # only "none" opts out; plain engines get no Xavier parameter at all
            n_groups = groups if work == "shared" else len(prompts)
            switch, during, after = RUNTIME_SWITCHES.get(mode, ("", None, None))
            before: List[Any] = []
            if switch:
                before = await asyncio.gather(*(getattr(x, switch)(during) for x in r.replicas))
            try:
                res = await run_mode(r, prompts, n_groups, c, max_tokens,
                                     xavier=not mode.startswith("none"),
                                     sticky=mode in STICKY_MODES)
            finally:
                if switch:
                    await asyncio.gather(*(getattr(x, switch)(b if after is None else after)
                                           for x, b in zip(r.replicas, before)))
            if mode in PEER_MODES:  # vLLM's connector: loaded tokens are the follow-ups'
                res["external_hit_rate"] = res.pop("followup_cached_tokens") / sum(
                    len(p) for p in prompts)
            res.pop("followup_cached_tokens", None)
            res.update(mode=mode, concurrency=c, prefix_tokens=prefix, workload=work)
            checks.append((res, prompts, n_groups))
            rows.append(res)
            print(_row(res), flush=True)
            on_row(rows)

        for prefix in prefixes:
            for c in concurrencies:
                for mode in modes:
                    seed += 1
                    await measure(mode, workload(seed, groups, per_group, prefix, 64, vocab), c,
                                  prefix, "shared")
                if switch_interval_us and "xavier" in pairs:
                    # the Xavier rows again with a shorter GIL switch interval in the engine
                    # processes (their cost: "none"; their gain: "batched")
                    xs = pairs["xavier"].replicas
                    old = await asyncio.gather(*(x.hook("set_switch_interval_us",
                                                        switch_interval_us) for x in xs))
                    try:
                        for mode in [m for m in ("none", "batched") if m in modes]:
                            seed += 1
                            await measure(f"{mode}-si{switch_interval_us}",
                                          workload(seed, groups, per_group, prefix, 64, vocab),
                                          c, prefix, "shared")
                    finally:
                        await asyncio.gather(*(x.hook("set_switch_interval_us", o)
                                               for x, o in zip(xs, old)))
        if unique:
            unique_modes = [m for m in ("plain", "noop-connector", "none")
                            if m in modes or (m == "plain" and "plain" in pairs)]
            for c in sorted({concurrencies[0], concurrencies[-1]}):
                for mode in unique_modes + ["batched"] + [m for m in modes
                                                          if m in (*RUNTIME_SWITCHES,
                                                                   DIRPUB_MODE)]:
                    seed += 1
                    await measure(mode, unique_workload(seed, groups * per_group,
                                                        max(prefixes) + 64, vocab), c,
                                  max(prefixes), "unique")
        for users in chat_users:  # issue #34's chat rows
            for mode in [m for m in modes
                         if m in ("plain", "local-hit", "none", "batched", *PEER_MODES)]:
                seed += 1
                chat = chat_workload(seed, users, turns, system, message, vocab)
                r = pairs["plain" if mode in PLAIN_MODES else
                          mode if mode in PEER_MODES else "xavier"]
                if mode not in PLAIN_MODES + PEER_MODES:
                    await _set_mode(r, mode)
                res, sent = await run_chat(r, chat, max_tokens, xavier=mode != "none",
                                           sticky=mode in STICKY_MODES)
                if mode in PEER_MODES:  # vLLM's connector counts no Xavier hits: what it
                    # loaded is inside the cached share (local prefix hits included)
                    res["external_hit_rate"] = float("nan")
                res.update(mode=mode, concurrency=users, prefix_tokens=system,
                           workload="chat")
                checks.append((res, sent, users))
                rows.append(res)
                print(_row(res), flush=True)
                on_row(rows)
        if settings:
            for row in rows:
                if row["mode"] in settings:
                    row["peer_settings"] = settings[row["mode"]]
                kind = row["mode"] if row["mode"] in VARIANT_PAIRS else "xavier"
                if (row["mode"] not in PLAIN_MODES + PEER_MODES
                        and f"steady_state_fill_{kind}" in settings):
                    row["steady_state_fill"] = settings[f"steady_state_fill_{kind}"]
        if report is not None:
            report["device_memory"] = await device_memory_report(pairs)
            on_row(rows)
        if "plain" not in pairs:
            print("[serving_bench] no plain pair: tokens not checked", flush=True)
            for row in rows:
                row.pop("_ids", None)
            on_row(rows)
            return rows
        print(f"[serving_bench] checking every row's tokens against plain vLLM "
              f"({check_groups} follow-ups per row, one at a time)", flush=True)
        for row, prompts, n_groups in checks:
            await check_tokens(pairs["plain"], row, prompts, n_groups, check_groups,
                               max_tokens)
            on_row(rows)
    return rows


async def device_memory_report(pairs: Dict[str, Replicas]) -> Dict[str, Any]:
    """Each pair's workers' device memory (torch's allocator: ``reserved``, the peak
    ``max_reserved``, vLLM's ``kv_cache_bytes``), its replica actors' processes' (where
    the transfer actor and Xavier's GPU tier live) and, per Xavier replica, the GPU memory
    Xavier adds beyond vLLM's own (``adds_bytes``): its workers' and actor's peak reserved
    minus those of a plain replica, each worker's KV cache left out of both sides (vLLM
    sizes a replica's KV cache from the memory free at its start, so two pairs' caches
    may differ by a few MiB: session 41's peers run); ``None`` without a plain worker of
    the same TP shape.  What Xavier's memory costs vLLM's KV cache is reported beside it
    (``kv_cache_vs_plain_bytes``: each replica's KV cache minus the plain pair's smallest).
    CUDA contexts are not counted."""
    per_pair: Dict[str, List[List[Dict[str, int]]]] = {}
    actors: Dict[str, List[Dict[str, int]]] = {}  # the replica actors' own processes
    for kind, r in pairs.items():
        per_pair[kind] = [await x.device_memory() for x in r.replicas]
        actors[kind] = [await x.actor_device_memory() for x in r.replicas]
    plain = per_pair.get("plain", [])
    # a plain worker's device memory beyond its KV cache, the largest of the pair's
    base = max((w["max_reserved"] - w["kv_cache_bytes"] for rep in plain for w in rep),
               default=0)
    base_actor = max((a["max_reserved"] for a in actors.get("plain", [])), default=0)
    workers = {len(rep) for rep in plain}  # workers per plain replica (TP)
    adds: Dict[str, List[Optional[int]]] = {}
    kv_vs_plain: Dict[str, List[Optional[int]]] = {}
    plain_kv = min((sum(w["kv_cache_bytes"] for w in rep) for rep in plain), default=0)
    measured = any(w["max_reserved"] for rep in plain for w in rep)  # a plain pair, on CUDA
    for kind, reps in per_pair.items():
        if kind == "plain" or not measured:
            continue
        kv_vs_plain[kind] = [sum(w["kv_cache_bytes"] for w in rep) - plain_kv
                             if len(rep) in workers else None for rep in reps]
        adds[kind] = [int(sum(w["max_reserved"] - w["kv_cache_bytes"] - base for w in rep)
                          + actor["max_reserved"] - base_actor)
                      if len(rep) in workers else None
                      for rep, actor in zip(reps, actors[kind])]
    print("[serving_bench] device memory (max reserved, GiB): "
          + ", ".join(f"{k} {[round(w['max_reserved'] / 2**30, 2) for rep in v for w in rep]}"
                      for k, v in per_pair.items())
          + "; Xavier adds (GiB): "
          + ", ".join(f"{k} {[None if a is None else round(a / 2**30, 2) for a in v]}"
                      for k, v in adds.items()), flush=True)
    if kv_vs_plain:
        print("[serving_bench] KV cache against plain's (MiB): "
              + ", ".join(f"{k} {[None if d is None else round(d / 2**20) for d in v]}"
                          for k, v in kv_vs_plain.items()), flush=True)
    return {"workers": per_pair, "actors": actors, "adds_bytes": adds,
            "kv_cache_vs_plain_bytes": kv_vs_plain}


async def check_tokens(plain: Replicas, row: Dict[str, Any], prompts: Sequence[List[int]],
                       groups: int, sample: int, max_tokens: int) -> None:
    """Generate a sample of the row's prompts again on plain vLLM (the second turn of the
    first ``sample`` groups: the requests that loaded another replica's KV; the first turn
    for unique prompts), one at a time, and record how many gave the row's tokens."""
    ids = row.pop("_ids")
    picked = [i for i in range(len(prompts)) if (i >= groups or groups == len(prompts))]
    picked = picked[:sample]
    equal = 0
    for i in picked:
        out = await plain.replicas[0].generate([prompts[i]], max_tokens=max_tokens,
                                               xavier=True)
        equal += out[0]["ids"] == ids[i]
    row["tokens_checked"] = len(picked)
    row["tokens_equal_plain"] = equal


async def fill_tiers(r: Replicas, prefix: int, vocab: int, saves: bool = True,
                     max_rounds: int = 200, quiet_rounds: int = 10) -> Dict[str, Any]:
    """Unmeasured requests with fresh prefixes, each asked on both replicas (the second
    loads it: shared, as the measured rows' prefixes are; sharing on, short outputs) until
    every replica's storage has evicted at least once: its top tier is full -- and, with
    vLLM's cache read in place, vLLM has handed published blocks out again (its own cache
    is full too) and Xavier saved some of them (``xavier_save_victims`` shared, the
    default, saves only blocks shown to be shared: a fill of prompts asked once would
    leave its tiers empty; off: the fill ends when vLLM's caches reuse their blocks).
    ``saves``: the pair saves victims (its policy is not ``off``): the fill then waits for
    its top tiers to fill, and gives that up only after ``quiet_rounds`` rounds of reuse
    with nothing saved at all (reported: ``saved_nothing``).  Returns what the fill reached."""
    t0 = time.perf_counter()
    reusing_since: Optional[int] = None
    for i in range(max_rounds):
        counters = [await x.counters() for x in r.replicas]
        evicted = [c.get("room_evicted", 0) for c in counters]
        in_place = any(c.get("in_place_published", 0) for c in counters)
        reused = [c.get("in_place_reused", 0) > 0 for c in counters]
        saving = any(c.get("in_place_victims", 0) for c in counters)
        # in place: vLLM's own caches evict (and, when victims are saved, Xavier's top tier
        # is full too); else Xavier's top tier is full.  (Session 23's GPU run waited for
        # room_evicted with victims off: a tier nothing fills, all of its 570 s.)
        if in_place and all(reused) and reusing_since is None:
            reusing_since = i
        quiet = (not saving and reusing_since is not None
                 and i - reusing_since >= (quiet_rounds if saves else 0))
        full = (all(reused) and (all(evicted) or quiet)) if in_place else all(evicted)
        if full:
            print(f"[serving_bench] storage tiers full after {i} fill rounds "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            keep = ("room_evicted", "in_place_published", "in_place_reused",
                    "in_place_victims", "storage_gpu_used_blocks", "storage_cpu_used_blocks")
            return {"rounds": i, "seconds": round(time.perf_counter() - t0, 1),
                    "saved_nothing": saves and not saving,
                    "replicas": [{k: c.get(k, 0) for k in keep} for c in counters]}
        if i % 10 == 0:
            used = [c.get("storage_gpu_used_blocks", c.get("storage_cpu_used_blocks", 0))
                    for c in counters]
            print(f"[serving_bench] filling storage: top-tier blocks used {used}", flush=True)
        await run_mode(r, workload(50_000 + i, 32, 2, prefix, 64, vocab), 32, 32, 1,
                       xavier=True)
    raise RuntimeError(f"--steady-state: storage not full after {max_rounds} rounds")


async def _set_mode(r: Replicas, mode: str) -> None:
    await asyncio.gather(*(x.set_batched_loads(mode != "per_request") for x in r.replicas))


HEADER = (f"{'mode':<15}{'work':>7}{'conc':>5}{'prefix':>7}{'req':>5}{'tok/s':>9}"
          f"{'TTFT p50':>10}{'TTFT p95':>10}{'fu tok/s':>9}{'fu TTFT50':>10}{'ext hit':>9}"
          f"{'calls/req':>10}{'load us/call':>13}{'export %':>9}")


def _row(r: Dict[str, Any]) -> str:
    return (f"{r['mode']:<15}{r.get('workload', 'shared'):>7}{r['concurrency']:>5}"
            f"{r['prefix_tokens']:>7}{r['requests']:>5}"
            f"{r['output_tokens_per_s']:>9.1f}{r['ttft_p50_ms']:>9.0f}ms"
            f"{r['ttft_p95_ms']:>8.0f}ms{r['followup_tokens_per_s']:>9.1f}"
            f"{r['followup_ttft_p50_ms']:>8.0f}ms{100 * r['external_hit_rate']:>8.1f}%"
            f"{r['load_calls_per_request']:>10.2f}{r['load_launch_us_per_call']:>13.0f}"
            f"{100 * r['export_launch_share']:>8.2f}%")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", help="model directory (default: built from --shape)")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", default="1,8,16,32")
    ap.add_argument("--prefix-tokens", default="1024,4096")
    ap.add_argument("--modes", help="default plain,local-hit,none,per_request,batched "
                    "(--quick: plain,noop-connector,none,batched, and --unique)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chat", default="",
                    help="users of the chat rows, e.g. 32,96 (issue #34): a shared system "
                         "prompt, growing per-user histories, a closed loop per user, round "
                         "robin; --chat-shape TURNS,SYSTEM,MESSAGE tokens (default 4,1024,768)")
    ap.add_argument("--chat-shape", default="4,1024,768")
    ap.add_argument("--unique", action="store_true",
                    help="add rows of a workload with no shareable prefix (plain, batched and "
                    "the asked modes of none / noop-connector / dropsaves / quiet0 / dirpub)")
    ap.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs")
    ap.add_argument("--steady-state", action="store_true",
                    help="fill every replica's top storage tier before measuring")
    ap.add_argument("--gpu-budget", help="GPU tier per replica (default 1GiB on cuda)")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="vLLM's, per replica (default 0.3 with one pair per GPU, 0.2 with "
                         "two, 0.13 with more)")
    ap.add_argument("--cpu-budget", help="CPU tier per replica (default 1GiB cuda, 512MiB cpu)")
    ap.add_argument("--gpus", help="a CUDA device id per replica, e.g. 0,1 (--device cuda)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor_parallel_size of every replica (cuda: each on GPUs 0..tp-1)")
    ap.add_argument("--switch-interval-us", type=int, default=0,
                    help="experiment: after each concurrency's rows, none and batched again "
                    "with sys.setswitchinterval at this many µs in the engine processes "
                    "(through the test hooks, which are otherwise off in the benchmark)")
    ap.add_argument("--peer-cpu-bytes", help="vllm-offload-fs: the CPU tier per replica "
                    "(default: Xavier's GPU + CPU budgets together, e.g. 2GiB on cuda)")
    ap.add_argument("--peer-fs-dir", default="/dev/shm/xavier-bench-vllm-fs",
                    help="vllm-offload-fs: the fs tier's directory, one for both replicas")
    ap.add_argument("--check-groups", type=int, default=8,
                    help="requests per row generated again on plain vLLM to check tokens "
                    "(0 with no plain mode asked: no plain pair, nothing checked)")
    ap.add_argument("--cpu-bind", default="replica", choices=["replica", "auto"],
                    help="CPU: each replica's OpenMP threads on cores of its own, the "
                    "physical cores split evenly (replica; an exported "
                    "VLLM_CPU_OMP_THREADS_BIND is kept), or vLLM's binding (auto: every "
                    "replica of the host on the same cores); --tp 2 binds per worker")
    ap.add_argument("--out", help="JSON path (default doc/results/serving_bench-<device>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.prefix_tokens = "8", "512"
        args.modes = args.modes or "plain,noop-connector,none,batched"
        args.unique = True
        args.groups, args.per_group, args.max_tokens = 8, 2, 16
    if args.model:
        model = args.model
    elif args.shape == "tiny":
        model = build_tiny_qwen2(os.environ.get("XAVIER_TINY_MODEL_DIR",
                                                os.path.join(REPO, ".cache", "tiny-qwen2")),
                                 SHAPES["tiny"])
    else:
        print(f"[serving_bench] building the {args.shape}-shaped model", flush=True)
        build = (build_qwen2_config_only if args.shape in DUMMY_WEIGHT_SHAPES
                 else build_tiny_qwen2)
        model = build(os.path.join(REPO, ".cache", args.shape), SHAPES[args.shape])
    modes = (args.modes or "plain,local-hit,none,per_request,batched").split(",")
    chat_shape = tuple(int(x) for x in args.chat_shape.split(","))
    if len(chat_shape) != 3 or min(chat_shape) < 1:
        ap.error(f"--chat-shape: TURNS,SYSTEM,MESSAGE positive token counts, got "
                 f"{args.chat_shape!r}")
    conc = [int(x) for x in args.concurrency.split(",")]
    prefixes = [int(x) for x in args.prefix_tokens.split(",")]
    gpus = args.gpus.split(",") if args.gpus else None
    if gpus and (args.device != "cuda" or len(gpus) != 2):
        ap.error("--gpus: two device ids (one per replica) with --device cuda")
    suffix = ("-quick" if args.quick else "") + ("" if args.shape == "tiny" else f"-{args.shape}")
    suffix += f"-{len(gpus)}gpus" if gpus else ""
    suffix += f"-tp{args.tp}" if args.tp > 1 else ""
    if gpus and args.tp > 1:
        ap.error("--gpus: not with --tp (each TP replica is placed on GPUs 0..tp-1)")
    suffix += "-steady" if args.steady_state else ""
    out = args.out or os.path.join(REPO, "doc", "results",
                                   f"serving_bench-{args.device}{suffix}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    import vllm

    report: Dict[str, Any] = {}

    def write(rows: List[Dict[str, Any]]) -> None:
        with open(out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
                       "host": platform.node(), "vllm": vllm.__version__, "model": model,
                       "args": vars(args), "shape": repr(SHAPES.get(args.shape)),
                       "rows": rows, **report}, f, indent=1)

    from xinference.model.llm.vllm.xavier.planning.budget import parse_bytes

    default_budgets = ("1GiB", "1GiB") if args.device == "cuda" else ("0", "512MiB")
    peer_cpu_bytes = parse_bytes("--peer-cpu-bytes", args.peer_cpu_bytes) if (
        args.peer_cpu_bytes) else (parse_bytes("--gpu-budget", args.gpu_budget or
                                               default_budgets[0])
                                   + parse_bytes("--cpu-budget", args.cpu_budget or
                                                 default_budgets[1]))
    rows = asyncio.run(bench_modes(model, args.device, modes, conc, prefixes, args.groups,
                                   args.per_group, args.max_tokens, gpus, args.steady_state,
                                   {"gpu_budget": args.gpu_budget,
                                    "cpu_budget": args.cpu_budget}, eager=args.eager,
                                   unique=args.unique,
                                   switch_interval_us=args.switch_interval_us, tp=args.tp,
                                   on_row=write, peer_cpu_bytes=peer_cpu_bytes,
                                   peer_fs_dir=args.peer_fs_dir,
                                   check_groups=args.check_groups, report=report,
                                   gpu_memory_utilization=args.gpu_memory_utilization,
                                   dummy_weights=args.shape in DUMMY_WEIGHT_SHAPES,
                                   chat_users=[int(x) for x in args.chat.split(",") if x],
                                   chat_shape=chat_shape, cpu_bind=args.cpu_bind))
    write(rows)
    print()
    print(HEADER)
    for r in rows:
        print(_row(r))
    print("\ntokens equal to plain vLLM (a sample of each row, generated again one at a time):")
    for r in rows:
        print(f"  {r['mode']:<16}{r.get('workload', 'shared'):>7} C{r['concurrency']:<3} "
              f"{r.get('tokens_equal_plain', '-')} of {r.get('tokens_checked', '-')}")
    for r in rows:
        if not r["mode"].startswith("none") and r["mode"] not in PLAIN_MODES + PEER_MODES:
            print(f"\ncounters ({r['mode']}, C{r['concurrency']}, prefix {r['prefix_tokens']}):")
            for rank, d in enumerate(r["counters"], start=1):
                keys = ("hit_blocks", "hit_tokens", "requests_with_hits", "batch_calls",
                        "logical_requests", "blocks_written", "rows_from_gpu_tier",
                        "rows_from_cpu_tier", "rows_from_vllm_cache", "in_place_published",
                        "in_place_reused", "in_place_victims",
                        "in_place_victims_held_elsewhere", "in_place_victims_never_shared",
                        "export_exported",
                        "export_skipped_no_slot",
                        "load_failures", "rejected_batches", "load_launch_us",
                        "export_launch_us", "export_launch_cpu_us", "room_demoted",
                        "room_evicted", "scheduler_us",
                        "scheduler_steps", "lookup_calls", "lookups_deferred",
                        "host_index_hits", "hits_not_paying", "hits_declined",
                        "lookups_skipped_not_paying", "lookups_skipped_held_nowhere",
                        "host_index_whole_launch", "cost_hit_wait_us",
                        "cost_prefill_ns_per_token")
                print(f"  replica rank {rank}: " + ", ".join(f"{k}={d.get(k, 0)}" for k in keys))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
