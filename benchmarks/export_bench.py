"""What a step's export costs the engine once the snapshot storage is full.

    python benchmarks/export_bench.py [--device cuda] [--shape qwen2.5-0.5b]
        [--gpu-gib 8] [--cpu-gib 1] [--step-blocks 512] [--steps 16] [--step-ms 20]

Builds a rank's storage as the transfer actor does (a GPU tier under ``--gpu-gib`` on the
device, a page-locked CPU tier of ``--cpu-gib`` in shared memory), the worker's storage
writer over it (the block directory in process), an engine KV cache of the model's shape
(TRITON_ATTN layout, bf16); fills the top tier with steps of ``--step-blocks`` new blocks
(a long prefill: 8192 tokens = 512 blocks), then runs ``--steps`` more, one every
``--step-ms`` (the engine's step), while the writer's room thread demotes and claims in
the background.  Prints, while filling and when full: the host time an export costs
the step (``launch``: what the worker's ``wait_for_save`` pays), the time until the
blocks are published, the blocks skipped for want of a free slot (the hit rate the
never-wait rule costs), and what the room thread did.

Writes ``doc/results/export_bench-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from xinference.model.llm.vllm.xavier.mechanism.block_copy import block_view  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (  # noqa: E402
    SnapshotStorage,
    TierConfig,
)
from xinference.model.llm.vllm.xavier.mechanism.storage_writer import StorageWriter  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.counters import Counters  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier  # noqa: E402

#: layers, KV heads, head size (block size 16)
SHAPES = {"qwen2.5-0.5b": (24, 2, 64), "tiny": (2, 2, 16)}


def engine_cache(shape: str, blocks: int, device: str) -> Dict[int, List[torch.Tensor]]:
    layers, heads, head = SHAPES[shape]
    return {0: [torch.zeros((blocks, 2, 16, heads, head), dtype=torch.bfloat16, device=device)
                for _ in range(layers)]}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    cache = engine_cache(args.shape, args.engine_blocks, args.device)
    layout = layout_of(cache)
    bb = layout.groups[0].block_bytes
    cuda = args.device != "cpu"
    tiers = [TierConfig(Tier.CPU, int(args.cpu_gib * 2**30) // bb * bb, shared_memory=True,
                        pin=cuda)]
    if cuda:
        tiers.insert(0, TierConfig(Tier.GPU, int(args.gpu_gib * 2**30) // bb * bb,
                                   device=args.device))
    st = SnapshotStorage(1, layout, tiers)
    counters = Counters()
    stream = torch.cuda.Stream() if cuda else None
    writer = StorageWriter(1, layout, {t: st.caches(t) for t in st.tiers}, LocalDirectory(),
                           torch.device(args.device), stream=stream, counters=counters,
                           room_blocks=args.step_blocks)
    views = {0: [block_view(t, 0) for t in cache[0]]}
    top = st.tiers[0]
    capacity = st.slots(top)
    next_key = 0

    def step() -> Dict[str, float]:
        nonlocal next_key
        rows = [(0, next_key + i, 1 + (next_key + i) % (args.engine_blocks - 1))
                for i in range(args.step_blocks)]
        next_key += args.step_blocks
        t0 = time.perf_counter()
        res = writer.export(views, rows)
        launch = time.perf_counter() - t0
        writer.flush(60) if args.wait_publish else None
        published = time.perf_counter() - t0
        time.sleep(max(0.0, args.step_ms / 1e3 - (time.perf_counter() - t0)))
        return {"launch_us": 1e6 * launch, "published_ms": 1e3 * published,
                "exported": res.exported, "skipped": res.skipped_no_slot}

    fill: List[Dict[str, float]] = []
    while counters.snapshot()["room_evicted"] == 0:  # until the room thread had to evict
        fill.append(step())
        if len(fill) % 20 == 0:
            print(f"[export_bench] filled {writer.used(top)}/{capacity} blocks", flush=True)
    before = counters.snapshot()
    full = [step() for _ in range(args.steps)]
    writer.flush(60)
    after = counters.snapshot()
    room = {k: after[k] - before[k] for k in after if k.startswith("room_")}
    writer.close()
    st.close()

    def summary(rows: List[Dict[str, float]]) -> Dict[str, float]:
        n = sum(r["exported"] + r["skipped"] for r in rows) or 1
        return {"steps": len(rows),
                "launch_us_p50": statistics.median(r["launch_us"] for r in rows),
                "launch_us_max": max(r["launch_us"] for r in rows),
                "published_ms_p50": statistics.median(r["published_ms"] for r in rows),
                "skipped_fraction": sum(r["skipped"] for r in rows) / n}

    return {"block_bytes": bb, "top_tier": top.name, "top_tier_blocks": capacity,
            "fill": summary(fill) if fill else {}, "full": summary(full), "room": room,
            "demote_gbps": (room.get("room_demoted", 0) * bb / (room["room_us"] / 1e6) / 1e9
                            if room.get("room_us") else 0.0)}


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--gpu-gib", type=float, default=8)
    ap.add_argument("--cpu-gib", type=float, default=1)
    ap.add_argument("--engine-blocks", type=int, default=4096)
    ap.add_argument("--step-blocks", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--wait-publish", action="store_true",
                    help="also wait for each step's publication (time it)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    r = run(args)
    print(f"\n{'phase':<6}{'steps':>6}{'launch us p50':>14}{'launch us max':>14}"
          f"{'published ms':>13}{'skipped':>9}")
    for phase in ("fill", "full"):
        s = r[phase]
        if s:
            print(f"{phase:<6}{s['steps']:>6}{s['launch_us_p50']:>14.0f}{s['launch_us_max']:>14.0f}"
                  f"{s['published_ms_p50']:>13.1f}{100 * s['skipped_fraction']:>8.1f}%")
    print(f"room while full: {r['room']}  demotion rate {r['demote_gbps']:.2f} GB/s")
    device = args.device.split(":")[0]
    out = args.out or os.path.join(REPO, "doc", "results", f"export_bench-{device}.json")
    with open(out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                   "args": vars(args), "result": r}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
