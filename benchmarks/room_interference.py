"""CUDA: what a demotion of Xavier's room thread (GPU tier -> page-locked CPU tier) costs a
decode step running beside it on the engine's stream.

    python benchmarks/room_interference.py [--blocks 128,256] [--reps 30]

The room thread of :mod:`xinference.model.llm.vllm.xavier.mechanism.storage_writer`
demotes the top tier's least recently used blocks to the CPU tier while vLLM runs.  Two
ways to move the bytes:

* ``uva``: the fused gather-scatter kernel writes the CPU tier's slots in place through
  their CUDA view (what the room thread does when the CPU tier is mapped, the default):
  its thread blocks sit on the SMs for as long as PCIe takes;
* ``uva, N programs``: the same kernel from N thread blocks that loop over the rows
  (``gather_scatter(programs=N)``), leaving the other SMs to the engine;
* ``dma``: a device gather into a staging buffer, then one copy-engine transfer into
  page-locked host memory (``gather_to_pinned``; what ``XAVIER_UVA=0`` does; the scatter
  into the tier's rows is then host work, not timed here).

A "decode step" here is a CUDA graph of one token through a Qwen2.5-0.5B-shaped stack of
GEMVs (24 layers: qkv, o, gate/up, down; bf16), replayed on its own stream.  Printed
(median of ``--reps``, ms): the step alone, the step while a demotion of ``--blocks``
blocks (24 layers, 192 KiB each) starts beside it, and the demotion's own time; each
kernel's last demotion is checked bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from typing import Callable, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transfer_bench import Shape, make_layers  # noqa: E402

from xinference.model.llm.vllm.xavier.mechanism.block_copy import gather_to_pinned  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.block_copy_triton import FusedCopier  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import (  # noqa: E402
    pin_host,
    unpin_host,
)
from xinference.model.llm.vllm.xavier.mechanism.uva import cuda_views  # noqa: E402

HIDDEN, INTER, LAYERS = 896, 4864, 24


def decode_graph(dev: torch.device, stream: torch.cuda.Stream) -> Callable[[], None]:
    """One token through the GEMV stack, captured as a CUDA graph; returns its replay."""
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [(torch.randn(HIDDEN, 1152, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
           torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
           torch.randn(HIDDEN, 2 * INTER, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
           torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)
          for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        h = x
        for wqkv, wo, wgu, wd in ws:
            a = (h @ wqkv)[:, :HIDDEN]
            h = h + a @ wo
            gu = h @ wgu
            h = h + (torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]) @ wd

    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph.replay


def timed(stream: torch.cuda.Stream, fn: Callable[[], None]
          ) -> Tuple[torch.cuda.Event, torch.cuda.Event]:
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
    return start, end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="128,256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--programs", default="8,16,32",
                    help="the narrow kernel's thread blocks (the room thread's demotions)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("room_interference: needs CUDA")
        return 1
    dev = torch.device("cuda", 0)
    shape = Shape()
    gpu_slots = 4096
    cpu_slots = 4096
    gpu_tier = make_layers(shape, gpu_slots, "cuda", 1)
    cpu_tier = [torch.zeros_like(t, device="cpu") for t in gpu_tier]
    pinned = pin_host(cpu_tier)
    views = cuda_views({0: cpu_tier}, dev)
    if views is None:
        print("room_interference: no CUDA view of the CPU tier (vLLM's op missing?)")
        return 1
    def rows(layers: List[torch.Tensor]) -> List[torch.Tensor]:  # block views, as Xavier's
        return [t.view(t.shape[0], -1).view(torch.int64) for t in layers]

    gpu_rows, cpu_rows, cuda_rows = rows(gpu_tier), rows(cpu_tier), rows(list(views[0]))
    engine, room = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    step = decode_graph(dev, engine)
    copier = FusedCopier(dev)

    def demote_uva(src: List[int], dst: List[int], programs: Optional[int] = None) -> None:
        copier.copy(("gpu", 0), gpu_rows, ("cpu", 0), cuda_rows, src, dst, programs=programs)

    def demote_dma(src: List[int], dst: List[int]) -> None:
        gather_to_pinned(gpu_tier, src, dev)

    print(f"{torch.cuda.get_device_name(dev)}; decode step: {LAYERS} layers of GEMVs "
          f"(hidden {HIDDEN}, intermediate {INTER}, bf16) as one CUDA graph; a block is "
          f"{shape.block_bytes() // 1024} KiB over {shape.layers} layers")
    print(f"{'case':28s} {'step ms':>8s} {'step x':>7s} {'demotion ms':>12s} {'GB/s':>6s}")
    alone: List[float] = []
    for _ in range(a.reps):
        s, e = timed(engine, step)
        e.synchronize()
        alone.append(s.elapsed_time(e))
    base = statistics.median(alone)
    print(f"{'step alone':28s} {base:8.3f} {1.0:7.2f}")
    for n in [int(x) for x in a.blocks.split(",")]:
        cases: List[Tuple[str, Callable[[List[int], List[int]], None]]] = [
            ("uva", demote_uva), ("dma", demote_dma)]
        cases += [(f"uva, {p} programs", functools.partial(demote_uva, programs=p))
                  for p in [int(x) for x in a.programs.split(",") if x]]
        for name, demote in cases:
            steps, moves = [], []
            for rep in range(a.reps + 3):
                src = [(rep * n + i) % gpu_slots for i in range(n)]
                dst = [(rep * 7 * n + i) % cpu_slots for i in range(n)]
                torch.cuda.synchronize(dev)
                ms, me = timed(room, functools.partial(demote, src, dst))
                s, e = timed(engine, step)
                e.synchronize()
                me.synchronize()
                if rep >= 3:
                    steps.append(s.elapsed_time(e))
                    moves.append(ms.elapsed_time(me))
            if name.startswith("uva"):  # the last demotion's rows, bit for bit
                torch.cuda.synchronize(dev)
                exact = all(torch.equal(c[torch.tensor(dst)], g[torch.tensor(src)].cpu())
                            for c, g in zip(cpu_rows, gpu_rows))
                if not exact:
                    print(f"{name}: WRONG BYTES")
                    return 1
            st, mv = statistics.median(steps), statistics.median(moves)
            gbs = n * shape.block_bytes() / (mv * 1e-3) / 1e9
            print(f"{f'{name}, {n} blocks beside':28s} {st:8.3f} {st / base:7.2f} "
                  f"{mv:12.3f} {gbs:6.1f}")
    unpin_host(pinned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
