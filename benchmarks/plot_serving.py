"""Plots of ``serving_bench.py`` results (matplotlib PNGs).

    python benchmarks/plot_serving.py doc/results/serving_bench-cuda-qwen2.5-0.5b.json \
        [--out doc/serving_bench-cuda-qwen2.5-0.5b.png]

One figure, three panels, per prefix length in the file: output tokens/s by concurrency,
TTFT p50 of all requests, and TTFT p50 of the follow-up turns (the cross-replica loads with
Xavier, recomputes without), one line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

PANELS = (("output_tokens_per_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
          ("followup_ttft_p50_ms", "follow-up TTFT p50 (ms)"))


def plot(result: Dict[str, Any], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: List[Dict[str, Any]] = result["rows"]
    prefixes = sorted({r["prefix_tokens"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(prefixes), len(PANELS), squeeze=False,
                             figsize=(4.2 * len(PANELS), 3.2 * len(prefixes)))
    for i, prefix in enumerate(prefixes):
        for j, (key, label) in enumerate(PANELS):
            ax = axes[i][j]
            for mode in modes:
                pts = sorted((r["concurrency"], r.get(key, float("nan"))) for r in rows
                             if r["mode"] == mode and r["prefix_tokens"] == prefix)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{label}, prefix {prefix}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"serving_bench {result.get('device')} vLLM {result.get('vllm')} "
                 f"{result.get('date', '')[:10]}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", help="PNG path (default: doc/<json name>.png)")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        result = json.load(f)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = args.out or os.path.join(
        repo, "doc", os.path.splitext(os.path.basename(args.json))[0] + ".png")
    print(plot(result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
