"""Split each cross-replica hit's wait, step by step, from an ``XAVIER_STEP_TRACE`` folder.

    python scripts/step_trace_report.py TRACE_FOLDER [--last N] [--json OUT.json]

Reads the ``trace-<pid>.jsonl`` files that the engines wrote (one line per connector call,
:mod:`xinference.model.llm.vllm.xavier.vllm_side.step_trace`) and, for every request that
was allocated blocks to load (``update_state_after_alloc`` with external tokens), the
moments of its path through vLLM's asynchronous load:

    new        vLLM added the request (on_new_request)
    answered   the first get_num_new_matched_tokens that gave an answer
    allocated  update_state_after_alloc with the hit's tokens
    sent       the end of the next build_connector_meta (the step that carries the load)
    launched   the end of the worker's start_load_kv of that step (the load is queued)
    reported   the end of the get_finished that names the request
    seen       update_connector_output naming it (the scheduler learns it)
    scheduled  the end of the build_connector_meta whose step computes its first tokens
    forward    the end of that step's start_load_kv (its forward starts right after)

Printed: the median and the p90 of each interval over the hits, the number of steps between
``allocated`` and ``scheduled``, each connector call's own time, and one hit's timeline with
every step in between."""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

POINTS = ("new", "answered", "allocated", "sent", "launched", "reported", "seen", "scheduled",
          "forward")


def read(folder: str) -> Dict[int, List[Dict[str, Any]]]:
    """Replica rank -> the lines of its processes (scheduler and workers, each line with the
    ``pid`` of its file), by start time."""
    out: Dict[int, List[Dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "trace-*.jsonl"))):
        pid = int(os.path.basename(path)[len("trace-"):-len(".jsonl")])
        with open(path, encoding="utf-8") as f:
            for x in f:
                if x.strip():
                    line = json.loads(x)
                    line["pid"] = pid
                    out.setdefault(int(line["rank"]), []).append(line)
    return {rank: sorted(lines, key=lambda x: x["t0"]) for rank, lines in out.items()}


def worker_calls(lines: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """Index of a ``build_connector_meta`` line -> the ``start_load_kv`` line of the same
    step: vLLM's n-th step built is the n-th a worker starts (every step reaches the
    workers, with or without a forward); the first worker process's (tensor-parallel rank
    0 is not known from the trace: any one worker's timing stands for the step)."""
    workers = sorted({x["pid"] for x in lines if x["role"] == "WORKER"})
    if not workers:
        return {}
    starts = [x for x in lines if x["pid"] == workers[0] and x["m"] == "start_load_kv"]
    metas = [i for i, x in enumerate(lines) if x["m"] == "build_connector_meta"]
    return {i: starts[n] for n, i in enumerate(metas) if n < len(starts)}


def _first(lines: List[Dict[str, Any]], start: int, pred: Any) -> Optional[int]:
    for i in range(start, len(lines)):
        if pred(lines[i]):
            return i
    return None


def hits(lines: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each loaded request's moments (ns) and the steps between its allocation and its
    first forward."""
    out = []
    step_start = worker_calls(lines)
    arrived: Dict[str, int] = {}  # request -> its first on_new_request's start
    answered: Dict[str, int] = {}  # request -> the end of its first answered match
    for y in lines:
        if y["m"] == "on_new_request":
            arrived.setdefault(y["req"], y["t0"])
        elif y["m"] == "get_num_new_matched_tokens" and y.get("ext") is not None:
            answered.setdefault(y["req"], y["t1"])
    for i, x in enumerate(lines):
        if x["m"] != "update_state_after_alloc" or not x.get("ext"):
            continue
        rid = x["req"]
        t: Dict[str, Optional[int]] = dict.fromkeys(POINTS)
        t["allocated"] = x["t1"]
        t["new"], t["answered"] = arrived.get(rid), answered.get(rid)
        sent = _first(lines, i, lambda y: y["m"] == "build_connector_meta")
        if sent is None:
            continue
        t["sent"] = lines[sent]["t1"]
        t["launched"] = step_start[sent]["t1"] if sent in step_start else None
        rep = _first(lines, sent, lambda y, rid=rid: y["m"] == "get_finished"
                     and rid in y.get("done", ()))
        t["reported"] = lines[rep]["t1"] if rep is not None else None
        seen = _first(lines, sent, lambda y, rid=rid: y["m"] == "update_connector_output"
                      and rid in y.get("done", ()))
        t["seen"] = lines[seen]["t0"] if seen is not None else None
        sched = _first(lines, sent + 1, lambda y, rid=rid: y["m"] == "build_connector_meta"
                       and int(y.get("reqs", {}).get(rid, 0)) > 0)
        steps = []
        if sched is not None:
            t["scheduled"] = lines[sched]["t1"]
            t["forward"] = step_start[sched]["t1"] if sched in step_start else None
            steps = [{"at_ms": (y["t1"] - x["t1"]) / 1e6, "tokens": y.get("tokens", 0)}
                     for y in lines[sent:sched + 1] if y["m"] == "build_connector_meta"]
        out.append({"req": rid, "t": t, "steps": steps,
                    "launch": step_start.get(sent)})
    return out


#: spans on the worker's step thread inside ``start_load_kv`` (:mod:`...trace_spans`)
STEP_THREAD_SPANS = ("save", "load", "load.locked", "load.plan", "load.launch")


def spans_by_process(ranks: Dict[int, List[Dict[str, Any]]]) -> Dict[int, List[Dict[str, Any]]]:
    """Every span line by the process that wrote it (one GIL each), whatever rank it
    carries (the process-wide actor bridge's carry none of a replica's)."""
    out: Dict[int, List[Dict[str, Any]]] = {}
    for lines in ranks.values():
        for y in lines:
            if y["role"] == "SPAN":
                out.setdefault(y["pid"], []).append(y)
    return out


def launch_split(spans: List[Dict[str, Any]], launch: Dict[str, Any]) -> Dict[str, float]:
    """What the worker did in the ``start_load_kv`` that launched a hit (ms), from the spans
    of its process: the call's wall and CPU time, each step-thread span inside it (wall and
    CPU), and for the process's other threads how long each kind of span overlapped the call
    (``busy: NAME``) and the CPU time of that overlap (prorated): who could hold the GIL
    meanwhile."""
    t0, t1 = launch["t0"], launch["t1"]
    out = {"start_load_kv": (t1 - t0) / 1e6, "start_load_kv cpu": launch.get("cpu", 0) / 1e6}
    for y in spans:
        if y["t1"] <= t0 or y["t0"] >= t1:
            continue
        wall = max(1, y["t1"] - y["t0"])
        if y["m"] in STEP_THREAD_SPANS:
            out[y["m"]] = out.get(y["m"], 0.0) + wall / 1e6
            out[y["m"] + " cpu"] = out.get(y["m"] + " cpu", 0.0) + y.get("cpu", 0) / 1e6
        else:
            overlap = min(t1, y["t1"]) - max(t0, y["t0"])
            key = f"busy: {y['m']}"
            out[key] = out.get(key, 0.0) + overlap / 1e6
            out[key + " cpu"] = (out.get(key + " cpu", 0.0)
                                 + y.get("cpu", 0) * overlap / wall / 1e6)
    return out


def _summary(v: List[float]) -> Dict[str, float]:
    s = sorted(v)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
            "max": s[-1], "n": len(s)}


def report(folder: str, last: int = 0) -> Dict[str, Any]:
    """The intervals over every hit, or over each replica's ``last`` hits."""
    ranks = read(folder)
    per_rank = {rank: hits(lines)[-last:] for rank, lines in ranks.items()}
    every = [h for found in per_rank.values() for h in found]
    spans: Dict[str, List[float]] = {}
    for h in every:
        t = h["t"]
        for a, b in zip(POINTS, POINTS[1:]):
            if t[a] is not None and t[b] is not None:
                spans.setdefault(f"{a} -> {b}", []).append((t[b] - t[a]) / 1e6)
        if t["allocated"] is not None and t["scheduled"] is not None:
            spans.setdefault("allocated -> scheduled (hit_load_wait)", []).append(
                (t["scheduled"] - t["allocated"]) / 1e6)
        if h["steps"]:  # (a hit never scheduled: aborted, or the trace ended first)
            spans.setdefault("steps allocated -> scheduled", []).append(
                float(len(h["steps"]) - 1))
    table = {k: _summary(v) for k, v in spans.items()}
    split: Dict[str, List[float]] = {}
    by_process = spans_by_process(ranks)
    for h in every:
        if h["launch"] is not None:
            for k, v in launch_split(by_process.get(h["launch"]["pid"], []),
                                     h["launch"]).items():
                split.setdefault(k, []).append(v)
    n_split = len(split.get("start_load_kv", []))
    for v in split.values():  # (a span absent from a hit's launch: 0 there)
        v.extend([0.0] * (n_split - len(v)))
    calls: Dict[str, List[float]] = {}
    for lines in ranks.values():
        for y in lines:
            calls.setdefault(y["m"], []).append((y["t1"] - y["t0"]) / 1e6)
    return {"hits": len(every), "intervals_ms": table,
            "launch_ms": {k: _summary(v) for k, v in sorted(split.items()) if v},
            "call_ms": {k: _summary(v) for k, v in sorted(calls.items())},
            "example": every[len(every) // 2] if every else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--json", default=None)
    ap.add_argument("--last", type=int, default=0,
                    help="only each replica's last N hits (e.g. the run's last C1 row)")
    a = ap.parse_args()
    r = report(a.folder, a.last)
    print(f"{r['hits']} loaded requests in {a.folder}")
    print(f"{'interval':42s} {'median ms':>10s} {'p90 ms':>8s} {'n':>4s}")
    for k, v in r["intervals_ms"].items():
        print(f"{k:42s} {v['median']:10.2f} {v['p90']:8.2f} {v['n']:4d}")
    if r["launch_ms"]:
        print("the worker's start_load_kv that launched each hit (ms; 'busy': the other "
              "threads' spans inside it)")
        for k, v in r["launch_ms"].items():
            print(f"  {k:40s} {v['median']:10.2f} {v['p90']:8.2f} {v['n']:4d}")
    print(f"{'connector call (its own time)':42s} {'median ms':>10s} {'p90 ms':>8s} "
          f"{'max ms':>8s} {'n':>6s}")
    for k, v in r["call_ms"].items():
        print(f"{k:42s} {v['median']:10.3f} {v['p90']:8.3f} {v['max']:8.2f} {v['n']:6d}")
    ex = r["example"]
    if ex is not None:
        base = ex["t"]["allocated"]
        print(f"one hit ({ex['req']}), ms after its allocation:")
        for p in POINTS:
            if ex["t"][p] is not None:
                print(f"  {p:10s} {(ex['t'][p] - base) / 1e6:8.2f}")
        print("  steps built between: " + ", ".join(
            f"{s['at_ms']:.2f} ms ({s['tokens']} tok)" for s in ex["steps"]))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
