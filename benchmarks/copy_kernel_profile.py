"""CUDA: where the time of one fused 512-block, 24-layer load step goes.

    python benchmarks/copy_kernel_profile.py [--blocks 512]

Prints (median of many reps): kernel-only device time (indices already on the
device), host time of one launch, the indices' upload, and the whole
``_run_transfers`` of a planned step (what ``transfer_bench`` reports as
device time), against a plain copy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xinference.model.llm.vllm.xavier.mechanism import block_copy_triton  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.gpu_transfer import GPUTransfer  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.plan import SlabConfig, plan_step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transfer_bench import Shape, make_layers, make_step  # noqa: E402


def events_median(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def host_median(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=512)
    a = ap.parse_args()
    shape = Shape()
    n = a.blocks
    local = make_layers(shape, n + 64, "cuda", 0)
    peer = make_layers(shape, n, "cuda", 1)
    eng = GPUTransfer(0, SlabConfig(max(512, n), 32, 2), copy_kernel="triton")
    eng.set_local_caches({0: local})
    eng.map_storage(1, Tier.GPU, {0: peer})
    batch = make_step(max(1, n // 16), min(16, n), n, n + 64, seed=1)
    plan, _ = plan_step(batch, eng.slab_config)
    t = plan.transfers[0]
    src_v, dst_v = eng._storages[(1, Tier.GPU)].layers[0], eng._local_layers[0]
    st, dt = block_copy_triton.pointer_table(src_v), block_copy_triton.pointer_table(dst_v)
    si = torch.from_numpy(t.src_slots[t.dst_rows]).cuda()
    di = torch.from_numpy(t.dst_blocks).cuda()
    words = int(dst_v[0].shape[1])

    def launch(num_warps: int = 4) -> None:
        block_copy_triton.gather_scatter(st, dt, len(dst_v), words, src_v[0].stride(0),
                                         dst_v[0].stride(0), si, di, num_warps=num_warps)

    moved = 2 * n * shape.block_bytes()
    a_ = torch.empty(n * shape.block_bytes() // 8, dtype=torch.int64, device="cuda").random_()
    b_ = torch.empty_like(a_)
    rows = {
        "plain copy of the same bytes (device)": events_median(lambda: b_.copy_(a_)),
        "fused kernel only (device)": events_median(launch),
        **{f"fused kernel only, num_warps={w} (device)": events_median(lambda w=w: launch(w))
           for w in (2, 8, 16)},
        "fused kernel launch (host)": host_median(launch),
        "index upload, one pinned copy (host)": host_median(
            lambda: eng._indices.upload([t.src_slots[t.dst_rows], t.dst_blocks])),
        "whole step launch (device, as transfer_bench)": events_median(
            lambda: eng._launch(eng._split(plan)[0])),
        "whole step launch (host: what the worker's step pays)": host_median(
            lambda: eng._launch(eng._split(plan)[0])),
    }
    print(f"{n} blocks x {shape.layers} layers, {moved / 2**20:.0f} MiB read+written")
    for k, us in rows.items():
        rate = f"{moved / us / 1e3:8.1f} GB/s" if "device" in k else ""
        print(f"  {k:<50} {us:9.1f} us {rate}")
    eng.close()


if __name__ == "__main__":
    main()
