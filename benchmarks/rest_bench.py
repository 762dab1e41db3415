"""Serving through a real ``xinference-local``'s REST API with the OpenAI client (#37):
where Xinference sends requests, and what that does to throughput and time to first token.

Rows, each a launch of the same model with two replicas, one after another on one server:

* ``plain-rr``: plain vLLM replicas (no Xavier), Xinference's cycle;
* ``xavier-rr``: Xavier, ``xavier_routing=round_robin`` (Xinference's cycle; a follow-up on
  the other replica loads its prefix from its peer);
* ``xavier-cache``: Xavier, ``xavier_routing=cache_aware`` (the default: a follow-up goes
  where its prefix was sent, a burst spills to the least loaded replica, which loads it);
* ``routing-alone``: ``cache_aware`` routing with Xavier's sharing all but off (nothing
  published in place, a CPU tier of 1 MiB: 32 of the tiny model's blocks; a launch with no
  tier is refused, and Xinference passes no per-request opt-out through): every replica has
  about only its own prefix cache.

Workloads (closed loop, ``--concurrency`` users, requests streamed):

* ``shared``: ``--groups`` prefixes (at least half the concurrency, made odd) of
  ``--prefix-chars`` characters, each asked
  ``--per-group`` times with a different question, in rounds (every group's first, then
  every group's second, ...);
* ``skew``: the same number of requests, ``--skew`` of them (90 %) on one prefix, the rest
  spread over the others.

Each (row, workload, concurrency) uses prefixes of its own (no carry-over between them).
Reported per row: output tok/s, TTFT p50/p95, the share of requests each replica served
(from the API's ``xinference_xavier_routed_requests_total`` where Xavier routes; the cycle
splits evenly by construction), and Xavier's own hits on the worker's metrics endpoint.
Not built: a local-hit floor row (Xinference's API cannot address one replica; the engine
bench ``serving_bench.py`` has it).

CPU: ``python benchmarks/rest_bench.py --out doc/results/rest_bench-cpu.json`` (the tiny
model; ~10 min on the 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tests.support.tiny_model import TinyQwen2, build_tiny_qwen2  # noqa: E402
from tests.support.xinference_server import (  # noqa: E402
    MODEL,
    Server,
    launch_body,
    metrics_endpoint,
    routed,
    scrape,
    xavier_envs,
)

ROWS = ("plain-rr", "xavier-rr", "xavier-cache", "routing-alone")


def row_body(model_dir: str, row: str) -> Dict[str, Any]:
    """The launch of ``row`` (see the module docstring)."""
    envs = xavier_envs()
    body = launch_body(model_dir, envs)
    if row == "plain-rr":
        body.pop("enable_xavier")
        body["envs"] = {k: v for k, v in envs.items() if not k.startswith("XAVIER_")}
    elif row == "xavier-rr":
        body["xavier_routing"] = "round_robin"
    elif row == "routing-alone":  # sharing all but off: nothing published in place and the
        # smallest tier (a launch with none is refused): 1 MiB, 32 of the tiny model's blocks
        body["envs"] = dict(envs, XAVIER_GPU_BUDGET="0", XAVIER_CPU_BUDGET="1MiB",
                            XAVIER_IN_PLACE="false")
    return body


def workload(kind: str, text: str, tag: str, groups: int, per_group: int, prefix_chars: int,
             skew: float) -> List[str]:
    """The prompts of one run, in the order they are sent."""
    def prefix(g: int) -> str:
        start = (g * 7919) % max(1, len(text) - prefix_chars)
        return f"[{tag} {g}] " + text[start:start + prefix_chars]

    n = groups * per_group
    if kind == "shared":
        order = [g for _ in range(per_group) for g in range(groups)]
    else:  # skew: every 10th request (for 0.9) on another prefix, the rest on prefix 0
        every = max(2, round(1 / max(1e-9, 1 - skew)))
        order = [(1 + i // every) % groups if i % every == every - 1 else 0 for i in range(n)]
    return [prefix(g) + f"\nQuestion {i} ({tag}): what comes next?\n" for i, g in enumerate(order)]


async def run(server: Server, prompts: Sequence[str], concurrency: int,
              max_tokens: int) -> Dict[str, Any]:
    """Closed loop: ``concurrency`` users take the next prompt when their last is done."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base + "/v1", api_key=server.token or "none",
                         max_retries=0, timeout=600)
    queue = list(reversed(prompts))
    ttfts: List[float] = []
    tokens = 0

    async def user() -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            t0 = time.perf_counter()
            first: Optional[float] = None
            used = 0
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:  # (cumulative where a server repeats it)
                    used = chunk.usage.completion_tokens
            tokens += used
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    ttfts.sort()
    return {"requests": len(prompts), "wall_s": wall, "output_tokens": tokens,
            "tok_per_s": tokens / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p95_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


def xavier_hits(server: Server) -> Dict[str, float]:
    try:
        endpoint = metrics_endpoint(server.home)
        return {labels["replica"]: value for labels, value in
                scrape(endpoint, "xinference:xavier_requests_with_hits_total")}
    except Exception:
        return {}


def delta(after: Dict[str, float], before: Dict[str, float]) -> Dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def router_cost(prompt_chars: int = 32_768, replicas: int = 2,
                reps: int = 2000) -> Dict[str, float]:
    """What one routing decision costs in the API process (the chain of a prompt of
    ``prompt_chars`` characters and the choice), and the router's memory once full."""
    import tracemalloc

    from xinference.model.llm.vllm.xavier.planning.routing import ReplicaRouter, chunk_chain

    text = (open(os.__file__).read() * 8)[:prompt_chars]
    router = ReplicaRouter()
    times = []
    for i in range(reps):
        prompt = text[:prompt_chars - 64] + f" question {i:08d}" * 3
        t0 = time.perf_counter()
        d = router.route(chunk_chain(prompt), len(prompt), list(range(replicas)))
        times.append(time.perf_counter() - t0)
        router.finished(d.replica, 0)
    tracemalloc.start()
    full = ReplicaRouter()
    for i in range(full.capacity * replicas // 128 + 1):  # distinct 128-chunk prompts
        full.route(chunk_chain(f"{i:08d}" + text), len(text) + 8, list(range(replicas)))
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    times.sort()
    return {"prompt_chars": prompt_chars, "route_p50_us": 1e6 * times[len(times) // 2],
            "route_p99_us": 1e6 * times[int(0.99 * len(times))],
            "bytes_per_replica_full": size / replicas, "capacity_chunks": full.capacity}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--workloads", default="shared,skew")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--prefix-chars", type=int, default=2500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--skew", type=float, default=0.9)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "doc", "results",
                                                  "rest_bench-cpu.json"))
    ap.add_argument("--router-only", action="store_true",
                    help="only the routing decision's cost and memory (no server)")
    a = ap.parse_args(argv)
    cost = router_cost()
    print(f"[rest_bench] routing a {cost['prompt_chars']}-character prompt: p50 "
          f"{cost['route_p50_us']:.0f} µs, p99 {cost['route_p99_us']:.0f} µs; a full router "
          f"holds {cost['bytes_per_replica_full'] / 2**20:.1f} MiB per replica", flush=True)
    if a.router_only:
        return 0

    home = tempfile.mkdtemp(prefix="rest-bench-")
    model_dir = build_tiny_qwen2(os.path.join(home, "model"), TinyQwen2())
    text = open(os.__file__).read() * 4
    os.makedirs(os.path.join(home, "server"))
    server = Server(os.path.join(home, "server"))
    results: List[Dict[str, Any]] = []
    try:
        for row in a.rows.split(","):
            t0 = time.monotonic()
            server.begin_test()
            try:
                server.launch(row_body(model_dir, row))
            except Exception as exc:
                detail = getattr(exc, "read", lambda: b"")().decode(errors="replace")
                exc = RuntimeError(f"{exc} {detail}")
                print(f"[rest_bench] {row}: launch failed: {exc}", flush=True)
                results.append({"row": row, "launch_failed": str(exc)[:500]})
                continue
            print(f"[rest_bench] {row}: launched in {time.monotonic() - t0:.0f} s", flush=True)
            for work in a.workloads.split(","):
                for c in [int(x) for x in a.concurrency.split(",")]:
                    tag = f"{row} {work} c{c}"
                    # an odd number of groups: Xinference's cycle then alternates the
                    # replicas between a group's requests (with an even number every request
                    # of a group lands on the same replica: round robin would look sticky)
                    prompts = workload(work, text, tag, max(a.groups, c // 2) | 1, a.per_group,
                                       a.prefix_chars, a.skew)
                    before_r, before_h = routed(server), xavier_hits(server)
                    res = asyncio.run(run(server, prompts, c, a.max_tokens))
                    time.sleep(6)  # replicas send their counters every 5 s
                    res.update(row=row, workload=work, concurrency=c,
                               routed={"/".join(k): v
                                       for k, v in routed(server, before_r).items()},
                               xavier_requests_with_hits=delta(xavier_hits(server), before_h))
                    results.append(res)
                    print(f"[rest_bench] {tag}: {res['tok_per_s']:.1f} tok/s, TTFT p50 "
                          f"{res['ttft_p50_ms']:.0f} ms p95 {res['ttft_p95_ms']:.0f} ms, "
                          f"routed {res['routed']}, hits {res['xavier_requests_with_hits']}",
                          flush=True)
            server.call("DELETE", f"/v1/models/{MODEL}")
            server.engines_gone()
    finally:
        server.stop()
    out = {"host": platform.node(), "python": platform.python_version(),
           "args": vars(a), "router_cost": cost, "rows": results}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
