"""What one step's export costs once the snapshot storage is full.

    python benchmarks/export_bench.py [--device cuda] [--shape qwen2.5-0.5b]
        [--gpu-gib 8] [--cpu-gib 1] [--step-blocks 512] [--steps 8] [--variants base,pinned]

Builds a rank's storage as ``TransferActor`` does (a GPU tier under ``--gpu-gib`` on the
device, a CPU tier of ``--cpu-gib`` in shared memory, the block directory in process),
an engine KV cache of the model's shape (TRITON_ATTN layout, bf16), fills the GPU tier
with steps of ``--step-blocks`` new blocks (a long prefill: 8192 tokens = 512 blocks),
then times ``--steps`` more steps, each of which must evict and demote a step's worth
of blocks.  Prints per variant: ms per step while filling and when full, and where the
full steps spend their time (cProfile, cumulative, storage functions).  Variants:

* ``pinned``: the CPU tier page-locked (``TierConfig.pin``, what ``TransferActor`` sets on
  a CUDA engine): a demotion's device-to-host copy runs at full speed;
* ``pageable``: the same tier not page-locked (the storage before 2026-11-29, session 4).

The full steps' time is also split as the storage reports it (``ExportResult.copy_us``:
block copies and fences; ``directory_us``: claims and registrations; the rest is
bookkeeping).

Writes ``doc/results/export_bench-<device>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import time
from typing import Any, Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from xinference.model.llm.vllm.xavier.block_copy import block_view  # noqa: E402
from xinference.model.llm.vllm.xavier.kv_schema import layout_of  # noqa: E402
from xinference.model.llm.vllm.xavier.load_batch import Tier  # noqa: E402
from xinference.model.llm.vllm.xavier.snapshot_storage import (  # noqa: E402
    LocalDirectory,
    SnapshotStorage,
    TierConfig,
)

#: layers, KV heads, head size (block size 16)
SHAPES = {"qwen2.5-0.5b": (24, 2, 64), "tiny": (2, 2, 16)}


def engine_cache(shape: str, blocks: int, device: str) -> Dict[int, List[torch.Tensor]]:
    layers, heads, head = SHAPES[shape]
    return {0: [torch.zeros((blocks, 2, 16, heads, head), dtype=torch.bfloat16, device=device)
                for _ in range(layers)]}


PROFILE_FILTER = "snapshot_storage|block_directory|index_|to\\b|synchronize"


async def run_variant(args: argparse.Namespace, variant: str) -> Dict[str, Any]:
    cache = engine_cache(args.shape, args.engine_blocks, args.device)
    layout = layout_of(cache)
    bb = layout.groups[0].block_bytes
    tiers = [TierConfig(Tier.CPU, int(args.cpu_gib * 2**30) // bb * bb, shared_memory=True,
                        pin=variant == "pinned")]
    if args.device != "cpu":
        tiers.insert(0, TierConfig(Tier.GPU, int(args.gpu_gib * 2**30) // bb * bb,
                                   device=args.device))
    st = SnapshotStorage(1, layout, tiers, LocalDirectory())
    views = {0: [block_view(t, 0) for t in cache[0]]}
    top = st.tiers[0]
    capacity = st.slots(top)
    next_key = 0

    split = {"copy_us": 0, "directory_us": 0}

    async def step() -> float:
        nonlocal next_key
        rows = [(0, next_key + i, 1 + (next_key + i) % (args.engine_blocks - 1))
                for i in range(args.step_blocks)]
        next_key += args.step_blocks
        t0 = time.perf_counter()
        res = await st.export(views, rows)
        for k in split:
            split[k] += getattr(res, k)
        return time.perf_counter() - t0

    fill = []
    while st.used(top) + args.step_blocks <= capacity:
        fill.append(await step())
        if len(fill) % 20 == 0:
            print(f"[export_bench] {variant}: filled {st.used(top)}/{capacity} blocks", flush=True)
    await step()  # the first step that evicts
    prof = cProfile.Profile()
    split.update(copy_us=0, directory_us=0)
    full = []
    prof.enable()
    for _ in range(args.steps):
        full.append(await step())
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(PROFILE_FILTER, 14)
    st.close()
    return {"variant": variant, "block_bytes": bb, "top_tier_blocks": capacity,
            "fill_steps": len(fill), "fill_ms_per_step": 1e3 * sum(fill) / max(1, len(fill)),
            "full_ms_per_step": 1e3 * sum(full) / len(full),
            "full_us_per_block": 1e6 * sum(full) / (len(full) * args.step_blocks),
            "full_copy_ms_per_step": split["copy_us"] / 1e3 / len(full),
            "full_directory_ms_per_step": split["directory_us"] / 1e3 / len(full),
            "profile": out.getvalue()}


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--gpu-gib", type=float, default=8)
    ap.add_argument("--cpu-gib", type=float, default=1)
    ap.add_argument("--engine-blocks", type=int, default=4096)
    ap.add_argument("--step-blocks", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variants", default="pinned,pageable")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = [asyncio.run(run_variant(args, v)) for v in args.variants.split(",")]
    print(f"\n{'variant':<9}{'block KiB':>10}{'top blocks':>11}{'fill ms/step':>13}"
          f"{'full ms/step':>13}{'us/block':>9}{'copies ms':>10}{'directory ms':>13}")
    for r in rows:
        print(f"{r['variant']:<9}{r['block_bytes'] / 1024:>10.0f}{r['top_tier_blocks']:>11}"
              f"{r['fill_ms_per_step']:>13.1f}{r['full_ms_per_step']:>13.1f}"
              f"{r['full_us_per_block']:>9.0f}{r['full_copy_ms_per_step']:>10.1f}"
              f"{r['full_directory_ms_per_step']:>13.1f}")
    for r in rows:
        print(f"\n--- {r['variant']}: where a full step goes\n{r['profile']}")
    device = args.device.split(":")[0]
    out = args.out or os.path.join(REPO, "doc", "results", f"export_bench-{device}.json")
    with open(out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                   "args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
