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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--holders", default="1,8,64")
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
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
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
