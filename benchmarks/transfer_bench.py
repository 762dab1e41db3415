"""Batched vs per-request KV loads on the same data.

    python benchmarks/transfer_bench.py [--device cpu|cuda] [--quick]

Per-request mode issues one ``load_gpu_requests_v1`` per request (the
baseline); batched mode issues one call carrying every request of the step.
Both load the same blocks into the same destinations from the same source
storages (two source ranks, GPU tier), with a vLLM-shaped KV cache
(24 layers, block size 16, 2 KV heads x 64, bf16 by default).  The engine runs in
this process, as it does in the vLLM worker.

Reported per mode: ``launch`` (the host time the caller's step spends: planning,
validation, index upload, kernel launches; what a live worker's ``load_launch_us``
counts), ``seconds`` (until the copies are complete and every lease released), and on
CUDA the device time of one planned step's copies.  ``copy_ceiling``: a plain
device-to-device copy measured in the same run, to compare the achieved copy rate with.

Prints tables and writes JSON to ``doc/results/transfer_bench-<device>.json``
(``...-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from xinference.model.llm.vllm.xavier.mechanism.gpu_transfer import GPUTransfer  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.load_batch import LoadBatch, Tier  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.plan import SlabConfig  # noqa: E402


@dataclass(frozen=True)
class Shape:
    layers: int = 24
    block_size: int = 16
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"

    def block_shape(self) -> Tuple[int, ...]:
        # vLLM CPU_ATTN / TRITON_ATTN-like: one block = [kv_heads, block_size, 2*head_dim]
        return (self.kv_heads, self.block_size, 2 * self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape():
            n *= d
        return n * self.layers * torch.empty((), dtype=self.torch_dtype).element_size()


def make_layers(shape: Shape, n_blocks: int, device: str, seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(shape.layers):
        bits = torch.randint(-2**15, 2**15 - 1, (n_blocks, *shape.block_shape()),
                             dtype=torch.int16, generator=gen)
        out.append(bits.view(shape.torch_dtype).to(device))
    return out


def make_step(requests: int, blocks: int, n_slots: int, n_dest: int, seed: int,
              ranks: Tuple[int, ...] = (1,)) -> LoadBatch:
    """``requests`` requests of ``blocks`` distinct blocks each; request i reads from
    ``ranks[i % len(ranks)]`` (one peer: the two-replica case)."""
    rng = np.random.default_rng(seed)
    total = requests * blocks
    dests = rng.choice(np.arange(1, n_dest), size=total, replace=False)
    slots = rng.choice(n_slots, size=total, replace=total > n_slots)
    keys = rng.integers(1, 2**62, size=total)
    table = np.zeros((total, 6), np.int64)
    table[:, 1] = keys
    table[:, 2] = np.asarray([ranks[(i // blocks) % len(ranks)] for i in range(total)])
    table[:, 3] = int(Tier.GPU)
    table[:, 4] = slots
    table[:, 5] = dests
    offsets = np.arange(0, total + 1, blocks, dtype=np.int64)
    return LoadBatch(tuple(f"req-{i}" for i in range(requests)), offsets, table)


class Bench:
    """An engine with local caches and two mapped source storages."""

    def __init__(self, shape: Shape, device: str, n_dest: int, n_slots: int,
                 slab: SlabConfig, kernel: str = "auto") -> None:
        self.shape, self.device, self.n_dest, self.n_slots, self.slab = (
            shape, device, n_dest, n_slots, slab)
        self.kernel = kernel
        self.engine: Optional[GPUTransfer] = None

    def open(self) -> None:
        self.engine = GPUTransfer(rank=0, slab_config=self.slab, copy_kernel=self.kernel)
        self.engine.set_local_caches({0: make_layers(self.shape, self.n_dest, self.device, 0)})
        for rank in (1, 2):
            self.engine.map_storage(rank, Tier.GPU, {0: make_layers(
                self.shape, self.n_slots, self.device, rank)})

    def run(self, batch: LoadBatch, mode: str) -> Dict[str, Any]:
        eng = self.engine
        assert eng is not None
        before = eng.counters.snapshot()
        t0 = time.perf_counter()
        parts = [batch] if mode == "batched" else batch.split()
        handles = [eng.load_gpu_requests_v1(one) for one in parts]
        launch = time.perf_counter() - t0
        for h in handles:
            h.wait(60)
        seconds = time.perf_counter() - t0
        after = eng.counters.snapshot()
        delta: Dict[str, Any] = {k: after[k] - before[k] for k in after}
        delta["seconds"] = seconds
        delta["launch_seconds"] = launch
        return delta


def median_run(bench: Bench, batch: LoadBatch, mode: str, reps: int) -> Dict[str, Any]:
    runs = [bench.run(batch, mode) for _ in range(reps)]
    best = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    best["seconds_all"] = [r["seconds"] for r in runs]
    best["launch_seconds"] = statistics.median(r["launch_seconds"] for r in runs)
    return best


def copy_ceiling(device: str, mib: int = 512, reps: int = 10) -> Dict[str, float]:
    """Plain copy of ``mib`` MiB, read + write bytes per second."""
    n = mib * 2**20 // 2
    a = torch.empty(n, dtype=torch.int16, device=device).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 2):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t0)
    t = statistics.median(times[2:])
    return {"mib": mib, "seconds": t, "rw_bytes_per_s": 2 * mib * 2**20 / t}


def device_step_time(bench: Bench, batch: LoadBatch, reps: int) -> float:
    """CUDA: device time of one planned step's copies (index uploads included,
    planning and the thread hand-off excluded), median over ``reps``."""
    from xinference.model.llm.vllm.xavier.planning.plan import plan_step

    eng = bench.engine
    assert eng is not None and eng._stream is not None
    plan, _ = plan_step(batch, eng.slab_config)
    jobs, _ = eng._split(plan)
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(eng._stream):
            s.record()
        eng._launch(jobs)
        with torch.cuda.stream(eng._stream):
            e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times[3:])


def inprocess_sweep(args: argparse.Namespace, shape: Shape,
                    kernel: str = "auto") -> List[Dict[str, Any]]:
    slab = SlabConfig(full_rows=512, small_rows=32, switch_after=2)
    # (requests per step, blocks per request, source peers)
    sweep = [(32, 16, 1)] if args.quick else [
        (1, 16, 1), (8, 16, 1), (16, 16, 1), (32, 16, 1), (32, 16, 2), (32, 4, 1),
        (32, 64, 1), (8, 64, 1)]
    max_blocks = max(r * b for r, b, _ in sweep)
    bench = Bench(shape, args.device, n_dest=max_blocks + 64, n_slots=max_blocks, slab=slab,
                  kernel=kernel)
    bench.open()
    rows = []
    for requests, blocks, peers in sweep:
        batch = make_step(requests, blocks, bench.n_slots, bench.n_dest, seed=requests * blocks,
                          ranks=(1, 2)[:peers])
        median_run(bench, batch, "batched", 2)  # warm-up (slabs, kernels)
        median_run(bench, batch, "per-request", 2)
        per = median_run(bench, batch, "per-request", args.reps)
        bat = median_run(bench, batch, "batched", args.reps)
        row = {"requests": requests, "blocks": blocks, "peers": peers, "kernel": kernel,
               "per_request": per, "batched": bat, "ratio": bat["seconds"] / per["seconds"]}
        if args.device == "cuda":
            row["batched_device_s"] = device_step_time(bench, batch, args.reps * 4)
        rows.append(row)
    bench.engine.close()  # type: ignore[union-attr]
    return rows


# --------------------------------------------------------------------------- output
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_sweep(rows: List[Dict[str, Any]], ceiling: Dict[str, float]) -> None:
    head = (f"{'kernel':>6} {'req x blk':>10} {'peers':>5} {'mode':>12} {'calls':>6} "
            f"{'xfers':>6} {'useful':>10} {'padded':>10} {'launch ms':>9} {'ms':>9} "
            f"{'GB/s r+w':>9} {'% ceil':>7} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        for mode in ("per_request", "batched"):
            m = r[mode]
            rate = 2 * m["useful_bytes"] / m["seconds"]
            print(f"{r['kernel']:>6} {r['requests']:>4} x {r['blocks']:<4} {r['peers']:>5} "
                  f"{mode:>12} {m['batch_calls']:>6} "
                  f"{m['transfers']:>6} {fmt_bytes(m['useful_bytes']):>10} "
                  f"{fmt_bytes(m['padded_bytes']):>10} {m['launch_seconds'] * 1e3:>9.3f} "
                  f"{m['seconds'] * 1e3:>9.2f} "
                  f"{rate / 1e9:>9.2f} {100 * rate / ceiling['rw_bytes_per_s']:>6.1f}% "
                  f"{(r['ratio'] if mode == 'batched' else 1.0):>6.2f}")
        if "batched_device_s" in r:
            dev = r["batched_device_s"]
            rate = 2 * r["batched"]["useful_bytes"] / dev
            print(f"{'':>6} {'':>10} {'':>5} {'device time':>12} {'':>6} {'':>6} {'':>10} {'':>10} "
                  f"{'':>9} {dev * 1e3:>9.3f} {rate / 1e9:>9.1f} "
                  f"{100 * rate / ceiling['rw_bytes_per_s']:>6.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only 32 x 16")
    ap.add_argument("--out", default=None, help="JSON path (default doc/results/...)")
    args = ap.parse_args()
    shape = Shape()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"transfer_bench: device {args.device}, shape {shape}, "
          f"block {fmt_bytes(shape.block_bytes())} over {shape.layers} layers, "
          f"torch {torch.__version__}", flush=True)
    ceiling = copy_ceiling(args.device, mib=256 if args.device == "cpu" else 1024)
    print(f"copy ceiling: {ceiling['rw_bytes_per_s'] / 1e9:.1f} GB/s (read + write, "
          f"{ceiling['mib']} MiB plain copy)", flush=True)
    kernels = ["torch", "triton"] if args.device == "cuda" else ["torch"]
    rows = []
    for kernel in kernels:
        rows += inprocess_sweep(args, shape, kernel)
    print_sweep(rows, ceiling)
    result: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "device": args.device, "torch": torch.__version__, "shape": shape.__dict__,
        "cpu_count": os.cpu_count(), "copy_ceiling": ceiling, "inprocess": rows}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    suffix = "-quick" if args.quick else ""  # keep the full sweep's results apart
    out = args.out or os.path.join(REPO, "doc", "results",
                                   f"transfer_bench-{args.device}{suffix}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
