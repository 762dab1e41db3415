"""A lookup's cost in the block directory by the number of replicas holding the prefix
(issue #36: one directory actor for every replica; 64 replicas sharing a system prompt).

    python benchmarks/directory_holders_bench.py [--holders 1,8,64] [--keys 512]
        [--tier vllm|gpu] [--reps 20]

Registers ``--keys`` block names (full 192-bit) on each of ``--holders`` ranks (``vllm``:
copies in vLLM's own cache, read in place and never leased; ``gpu``: Xavier's GPU tier)
and times ``query_prefix`` of all of them from another rank, without leases (as the
connector's lookups ask).  Pure Python, no actor: the time the directory actor would
spend per lookup.  Writes ``doc/results/directory_holders_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--holders", default="1,8,64")
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--tier", choices=("vllm", "gpu"), default="vllm")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "doc",
                                                  "results", "directory_holders_bench.json"))
    a = ap.parse_args()
    tier = int(Tier.VLLM if a.tier == "vllm" else Tier.GPU)
    rows = []
    for holders in [int(h) for h in a.holders.split(",")]:
        d = BlockDirectory()
        keys = [secrets.randbits(192) for _ in range(a.keys)]
        for rank in range(holders + 1):
            d.register_rank(rank)
        for rank in range(1, holders + 1):
            d.register(rank, [(0, k, tier, i, 1) for i, k in enumerate(keys)], 7)
        t0 = time.perf_counter()
        for _ in range(a.reps):
            hit = d.query_prefix([0], keys, exclude_rank=0, lease=False)
        ms = 1000 * (time.perf_counter() - t0) / a.reps
        assert hit.num_hits == a.keys
        rows.append({"holders": holders, "keys": a.keys, "tier": a.tier, "ms_per_lookup": ms})
        print(f"{holders:4d} holders, {a.keys} keys ({a.tier}): {ms:7.2f} ms per lookup")
    with open(a.out, "w") as f:
        json.dump({"host": platform.node(), "python": platform.python_version(),
                   "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
