"""Block directory memory and speed over many registrations (pure Python, no actors).

    python benchmarks/directory_bench.py [--registrations 100000]

Four ranks with bounded storages (LRU slots) export distinct blocks; every
export that needs a slot claims an LRU victim from the directory; every 8th
export a peer queries a 16-block prefix (leases) and releases it afterwards.
Prints directory size and traced Python memory at checkpoints: once the slots
are full, both must stay flat.  Writes doc/results/directory_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.slot_allocator import SlotAllocator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--registrations", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--slots", type=int, default=4096, help="slots per rank")
    a = ap.parse_args()
    tracemalloc.start()
    d = BlockDirectory()
    allocs = {r: SlotAllocator(a.slots) for r in range(1, a.ranks + 1)}
    gens = {}
    checkpoints = sorted({1_000, 10_000, a.registrations // 2, a.registrations})
    rows = []
    t0 = time.perf_counter()
    held = []
    for i in range(1, a.registrations + 1):
        rank = 1 + i % a.ranks
        alloc = allocs[rank]
        slot = alloc.take_free()
        while slot is None:
            victims = alloc.victims(4)
            granted = d.claim(rank, 0, 0, victims)
            for s in granted:
                alloc.release(s)
            slot = alloc.take_free()
        key = i
        gen = alloc.assign(key, slot)
        gens[(rank, slot)] = gen
        d.register(rank, [(0, key, 0, slot, gen)])
        if i % 8 == 0:
            q = d.query(0, list(range(i - 15, i + 1)), exclude_rank=0)
            held.append(q.lease_ids)
            if len(held) > 4:
                d.release(held.pop(0))
        if i in checkpoints:
            current, peak = tracemalloc.get_traced_memory()
            rows.append({"registrations": i, "blocks": d.num_blocks, "keys": d.num_keys,
                         "outstanding_leases": d.outstanding_leases,
                         "traced_mib": current / 2**20, "peak_mib": peak / 2**20,
                         "seconds": time.perf_counter() - t0})
    for h in held:
        d.release(h)
    print(f"{'registrations':>13} {'blocks':>8} {'keys':>8} {'leases':>7} {'traced MiB':>11} "
          f"{'peak MiB':>9} {'s':>7}")
    for r in rows:
        print(f"{r['registrations']:>13} {r['blocks']:>8} {r['keys']:>8} "
              f"{r['outstanding_leases']:>7} {r['traced_mib']:>11.2f} {r['peak_mib']:>9.2f} "
              f"{r['seconds']:>7.2f}")
    print(f"after releasing everything: outstanding leases {d.outstanding_leases}, "
          f"claims refused {d.stats.claims_refused}, "
          f"bound {a.ranks * a.slots} slots")
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "doc",
                       "results", "directory_bench.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"args": vars(a), "rows": rows, "final_leases": d.outstanding_leases,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
