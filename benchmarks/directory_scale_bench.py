"""The block directory at 64 replicas (issue #36): memory per entry, the cost of
unregistering a rank with many blocks, and a lookup's cost by the number of holders.

    python benchmarks/directory_scale_bench.py [--entries 200000] [--holders 1,8,64]
        [--keys 512] [--reps 20] [--out FILE]

Pure Python, no actor: what the supervisor's directory actor would spend.  Three parts:

* **memory**: Python memory traced (``tracemalloc``) per entry, for ``--entries`` blocks
  of one rank (one holder per name), and for 64 ranks holding the same 4096 names;
* **unregister**: 4 ranks of ``--entries / 2`` blocks each; the time of
  ``unregister_rank`` of one, and the longest of the 50 lookups that follow (they sweep
  what the rank left);
* **lookups**: ``query_prefix`` of ``--keys`` names held by each of ``--holders`` ranks,
  without leases (the connector's lookups), the copies in vLLM's cache (``vllm``) or in
  Xavier's GPU tier with every copy leased once (``gpu-leased``: no copy is preferred, the
  worst case of the choice); p50 of ``--reps``.

* **simulation** (``--replicas``, default 64): one second of that many replicas against one
  directory, at the per-replica rates of the H200 C32 run of session 26 (shared 8K
  prefixes, ``results/serving_bench-cuda-qwen2.5-0.5b-steady-session26.json``: 32
  requests in 3.08 s, 8320 blocks published in place in 88 steps per replica): each
  replica registers the blocks of a step :data:`REGISTER_CALLS_PER_S` times a second
  (:data:`BLOCKS_PER_REGISTER` new blocks, as many of its old ones forgotten: vLLM reused
  them) and looks up :data:`LOOKUPS_PER_S` prompts a second whose first 512 blocks every
  replica holds; each replica holds ``--held`` blocks.  Prints the directory's busy time
  per simulated second (above 1 s it cannot keep up) and each call's cost; and the busy
  time when a same-host peer of each replica holds the prefix (the host index answers it,
  the directory is asked only from the block after it: a miss here); and how long a
  lookup's answer takes when the same calls arrive at random over the second and the actor
  serves them one at a time (``lookup_answer_ms_*``: queueing included); and from those
  answers what a replica's scheduler waits per step (``scheduler_wait_ms_per_step_*``): each
  lookup is taken by a step drawn at random among the replica's :data:`STEPS_PER_S`, which
  waits for its answer plus ``--rtt-ms`` (the xoscar round trip: the H100 C1 rows' wait per
  lookup with an idle directory, 0.85-0.95 ms), within the step's wait budget; an upper
  bound, since the request is never reached before its lookup could be answered.  Three
  runs (session 40): the directory's work alone (``simulation``, as sessions 28-38
  reported it); the same plus what each call costs the actor's process (xoscar's
  deserialization of the arguments as the engines send them, and ``--dispatch-ms`` a call:
  ``simulation_with_call_costs``); and with each replica's publisher making one call at a
  time, what it publishes meanwhile in its next, and its scheduler's forgets likewise
  (``simulation_coalesced``).  Each step
  that reuses blocks is a ``forget`` (the scheduler) and a ``register`` (the publisher).

``--code CHECKOUT`` measures another checkout's ``planning/`` (two versions of the
directory compared in one session, on one machine).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import secrets
import statistics
import sys
import time
import tracemalloc
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANNING = os.path.join("xinference", "model", "llm", "vllm", "xavier", "planning")
GPU, VLLM = 0, 2
BlockDirectory: Any = None
#: per replica, from the H200 C32 run (see the docstring)
REGISTER_CALLS_PER_S = 29
BLOCKS_PER_REGISTER = 94
LOOKUPS_PER_S = 10.4
#: scheduler steps a second per replica in that run (88 steps in 3.08 s)
STEPS_PER_S = 28.6
#: a step waits for lookup answers at most this long (``DirectoryLookups``' wait budget)
STEP_WAIT_BUDGET_MS = 10.0


def load_directory(checkout: str) -> Any:
    """``BlockDirectory`` of ``checkout``'s ``planning/`` (a package of its own, so that two
    checkouts never mix; the planning layer imports nothing above it)."""
    path = os.path.join(checkout, PLANNING)
    name = f"planning_under_test_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.block_directory").BlockDirectory


def bytes_per_entry(ranks: int, names: int) -> float:
    """Traced bytes per entry: ``ranks`` ranks each holding the same ``names`` names."""
    keys = [secrets.randbits(192) for _ in range(names)]
    gc.collect()
    tracemalloc.start()
    d = BlockDirectory()
    for rank in range(1, ranks + 1):
        d.register(rank, [(0, k, VLLM, i, 3) for i, k in enumerate(keys)], 1 << 62)
    gc.collect()
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / (ranks * names)


def unregister(entries: int) -> Dict[str, float]:
    d = BlockDirectory()
    per_rank = entries // 2
    for rank in range(1, 5):
        keys = [secrets.randbits(192) for _ in range(per_rank)]
        d.register(rank, [(0, k, VLLM, i, 3) for i, k in enumerate(keys)], 7)
    probe = [secrets.randbits(192) for _ in range(512)]
    t0 = time.perf_counter()
    d.unregister_rank(1)
    took = time.perf_counter() - t0
    after = []
    for _ in range(50):
        t0 = time.perf_counter()
        d.query_prefix([0], probe, exclude_rank=0, lease=False)
        after.append(time.perf_counter() - t0)
    return {"entries_of_the_rank": per_rank, "entries_in_all": 4 * per_rank,
            "unregister_ms": 1e3 * took, "max_lookup_after_ms": 1e3 * max(after)}


def lookup_ms(holders: int, keys_n: int, tier: str, reps: int) -> float:
    d = BlockDirectory()
    keys = [secrets.randbits(192) for _ in range(keys_n)]
    for rank in range(holders + 1):
        d.register_rank(rank)
    code = VLLM if tier == "vllm" else GPU
    for rank in range(1, holders + 1):
        d.register(rank, [(0, k, code, i, 1) for i, k in enumerate(keys)], 7)
    if tier == "gpu-leased":  # every copy leased once by some other loader
        for rank in range(1, holders + 1):
            d.query_prefix([0], keys, exclude_rank=holders + 1 + rank)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        hit = d.query_prefix([0], keys, exclude_rank=0, lease=False)
        times.append(time.perf_counter() - t0)
    assert hit.num_hits == keys_n
    return 1e3 * statistics.median(times)


def simulation(replicas: int, held: int, keys_n: int, rtt_ms: float = 1.0,
               dispatch_ms: float = 0.0, coalesce: bool = False) -> Dict[str, float]:
    """One simulated second of ``replicas`` replicas (see the module docstring), event by
    event: each call arrives at a random time of the second and the actor serves them one
    at a time in arrival order.  A call costs what the directory's method takes here, plus
    (``dispatch_ms`` > 0) what the actor's process spends receiving it: xoscar's
    deserialization of its arguments as the engines send them (timed here) and
    ``dispatch_ms`` (``directory_call_bench.py``'s empty call).  Each step of a replica
    that reuses blocks sends a ``forget`` (its scheduler) and a ``register`` (its
    publisher).  ``coalesce``: a replica's publisher has one call out at a time; what it
    publishes meanwhile goes in its next call, made when the last is answered; its
    scheduler's forgets likewise (:mod:`~.planning.coalesced_forgets`)."""
    import heapq

    from xoscar.serialization import deserialize, serialize

    from xinference.model.llm.vllm.xavier.planning.directory_types import Packed

    d = BlockDirectory()
    rng = secrets.SystemRandom()
    prefix = [secrets.randbits(192) for _ in range(keys_n)]
    owned: Dict[int, List[Any]] = {}  # rank -> its blocks (name, slot), oldest first
    for rank in range(1, replicas + 1):
        d.register_rank(rank)
        own = [(k, i) for i, k in enumerate(
            prefix + [secrets.randbits(192) for _ in range(held - keys_n)])]
        d.register(rank, [(0, k, VLLM, i, 1) for k, i in own], 7)
        owned[rank] = own
    arrivals: List[Any] = []  # (time, order, kind, rank)
    for rank in range(1, replicas + 1):
        for _ in range(REGISTER_CALLS_PER_S):
            at = rng.random()
            arrivals += [(at, len(arrivals), "forget", rank), (at, len(arrivals) + 1,
                                                               "publish", rank)]
        arrivals += [(rng.random(), len(arrivals) + i, "lookup", rank)
                     for i in range(round(LOOKUPS_PER_S))]
    heapq.heapify(arrivals)
    received = (lambda args: deserialize(*serialize(args))) if dispatch_ms > 0 else None
    pending: Dict[int, List[Any]] = {}  # rank -> rows published while its call is out
    out: Dict[int, bool] = {}  # rank -> a register call of its publisher is out
    forget_pending: Dict[int, List[Any]] = {}  # the same for its scheduler's forgets
    forget_out: Dict[int, bool] = {}
    calls: List[Any] = []  # (issued, order, kind, rank, rows)
    pub_rows: Dict[Any, Any] = {}  # (rank, time) -> the rows its step publishes
    spent = {"register": 0.0, "forget": 0.0, "lookup": 0.0, "after_host_hit": 0.0}
    count = {"register": 0, "forget": 0, "lookup": 0, "publications": 0}
    free_at, answered = 0.0, []

    def step_rows(rank: int) -> Any:
        """A step's reuse: the oldest blocks after the prefix go, new ones take their slots."""
        own = owned[rank]
        gone = own[keys_n:keys_n + BLOCKS_PER_REGISTER]
        del own[keys_n:keys_n + BLOCKS_PER_REGISTER]
        new = [(secrets.randbits(192), slot) for _, slot in gone]
        own += new
        return gone, [(0, k, VLLM, slot, 2) for k, slot in new]

    while arrivals or calls:
        if arrivals and (not calls or arrivals[0][0] <= max(free_at, calls[0][0])):
            at, order, kind, rank = heapq.heappop(arrivals)
            if kind == "publish":
                count["publications"] += 1
                if coalesce and out.get(rank):
                    pending.setdefault(rank, []).extend(pub_rows.pop((rank, at)))
                    continue
                out[rank] = True
                heapq.heappush(calls, (at, order, "register", rank, pub_rows.pop((rank, at))))
            elif kind == "forget":
                gone, rows = step_rows(rank)
                pub_rows[(rank, at)] = rows
                if coalesce and forget_out.get(rank):
                    forget_pending.setdefault(rank, []).extend(gone)
                    continue
                forget_out[rank] = True
                heapq.heappush(calls, (at, order, "forget", rank, gone))
            else:
                heapq.heappush(calls, (at, order, "lookup", rank, None))
            continue
        issued, order, kind, rank, rows = heapq.heappop(calls)
        t0 = time.perf_counter()
        if kind == "register":
            args: Any = (rank, Packed(rows), 7)
            if received is not None:
                args = received(args)
            d.register(rank, args[1].value, 7)
        elif kind == "forget":
            args = (rank, VLLM, Packed({0: [(slot, 2) for _, slot in rows]}))
            if received is not None:
                args = received(args)
            d.forget(rank, VLLM, args[2].value)
        else:
            args = ([0], [prefix], rank, False)
            if received is not None:
                args = received(args)
            hit = d.query_prefix([0], args[1][0], exclude_rank=rank, lease=False)
            assert hit.num_hits == keys_n
            t1 = time.perf_counter()
            # with a same-host holder, the host index answers the prefix and the directory
            # is asked only from the block after it (here: the prompt's own, a miss)
            d.query_prefix([0], [secrets.randbits(192)], exclude_rank=rank, lease=False)
            spent["after_host_hit"] += time.perf_counter() - t1 + dispatch_ms / 1e3
            t0 += time.perf_counter() - t1
        took = time.perf_counter() - t0 + dispatch_ms / 1e3
        spent[kind] += took
        count[kind] += 1
        free_at = max(issued, free_at) + took
        if kind == "lookup":
            answered.append(free_at - issued)
        elif kind == "register":
            out[rank] = False
            if pending.get(rank):  # what it published meanwhile: its next call, now
                out[rank] = True
                heapq.heappush(calls, (free_at, order, "register", rank, pending.pop(rank)))
        else:
            forget_out[rank] = False
            if forget_pending.get(rank):
                forget_out[rank] = True
                heapq.heappush(calls, (free_at, order, "forget", rank,
                                       forget_pending.pop(rank)))
    busy = spent["register"] + spent["forget"] + spent["lookup"]
    waits = step_waits(answered, replicas, rtt_ms)
    answered.sort()
    return {"replicas": replicas, "held_per_replica": held, "entries": replicas * held,
            "dispatch_ms": dispatch_ms, "coalesce": coalesce,
            "busy_s_per_simulated_s": busy,
            "busy_s_if_same_host_peers_hold_the_prefix": spent["register"] + spent["forget"]
            + spent["after_host_hit"],
            "register_ms_per_call": 1e3 * spent["register"] / count["register"],
            "forget_ms_per_call": 1e3 * spent["forget"] / count["forget"],
            "lookup_ms_per_call": 1e3 * spent["lookup"] / count["lookup"],
            "publications": count["publications"], "register_calls": count["register"],
            "forget_calls": count["forget"], "lookups": count["lookup"],
            "lookup_answer_ms_p50": 1e3 * answered[len(answered) // 2],
            "lookup_answer_ms_p99": 1e3 * answered[int(len(answered) * 0.99)],
            "lookup_answer_ms_max": 1e3 * answered[-1],
            "scheduler_wait_ms_per_step_mean": statistics.fmean(waits),
            "scheduler_wait_ms_per_step_p99": waits[int(len(waits) * 0.99)],
            "scheduler_steps_with_a_wait": sum(1 for w in waits if w > 0) / len(waits)}


def step_waits(answered_s: List[float], replicas: int, rtt_ms: float) -> List[float]:
    """Each simulated step's wait (ms, sorted): the lookups (answer times in arrival order,
    dealt to the replicas in turn) fall into random steps of their replica; a step waits for
    the slowest of its lookups (they are awaited together) plus the round trip, within the
    budget."""
    rng = secrets.SystemRandom()
    steps = round(STEPS_PER_S)
    waits = [[0.0] * steps for _ in range(replicas)]
    for i, seconds in enumerate(answered_s):
        step = waits[i % replicas]
        j = rng.randrange(steps)
        step[j] = max(step[j], min(STEP_WAIT_BUDGET_MS, 1e3 * seconds + rtt_ms))
    return sorted(w for per_replica in waits for w in per_replica)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--holders", default="1,8,64")
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--held", type=int, default=8192, help="blocks each replica holds")
    ap.add_argument("--rtt-ms", type=float, default=1.0,
                    help="a lookup's round trip to the directory, on top of its service")
    ap.add_argument("--dispatch-ms", type=float, default=0.25,
                    help="the actor process's CPU for a call beyond its arguments "
                         "(directory_call_bench.py's empty call: 0.2-0.3 ms on the CPU machine)")
    ap.add_argument("--code", default=HERE, help="the checkout whose directory is measured")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "doc",
                                                  "results", "directory_scale_bench.json"))
    a = ap.parse_args()
    global BlockDirectory
    BlockDirectory = load_directory(a.code)
    out: Dict[str, Any] = {"host": platform.node(), "python": platform.python_version(),
                           "code": a.code}
    out["bytes_per_entry"] = {
        "one holder per name": bytes_per_entry(1, a.entries),
        "64 holders per name": bytes_per_entry(64, 4096)}
    print("bytes per entry:", {k: round(v) for k, v in out["bytes_per_entry"].items()})
    out["unregister"] = unregister(a.entries)
    print("unregister:", {k: round(v, 2) for k, v in out["unregister"].items()})
    rows: List[Dict[str, Any]] = []
    for tier in ("vllm", "gpu-leased"):
        for holders in [int(h) for h in a.holders.split(",")]:
            ms = lookup_ms(holders, a.keys, tier, a.reps)
            rows.append({"holders": holders, "keys": a.keys, "tier": tier, "p50_ms": ms})
            print(f"{holders:4d} holders, {a.keys} keys ({tier}): {ms:7.2f} ms per lookup")
    out["lookups"] = rows
    # the directory's work alone (as sessions 28-38 measured it), then with what each call
    # costs the actor's process on top, then with the publishers' calls coalesced
    for name, dispatch, coalesce in (("simulation", 0.0, False),
                                     ("simulation_with_call_costs", a.dispatch_ms, False),
                                     ("simulation_coalesced", a.dispatch_ms, True)):
        out[name] = simulation(a.replicas, a.held, a.keys, a.rtt_ms, dispatch, coalesce)
        print(f"{name}:", {k: round(v, 3) for k, v in out[name].items()}, flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
