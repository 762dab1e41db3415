"""Host (CPU) time of one batched KV load, piece by piece, on CPU.

    python benchmarks/host_path_profile.py [--reps 30] [--profile] [--top 25] [--only NAME]

Written for issue #34 ("host work of a 512-block load <= 0.3 ms"); session 25's numbers
before and after vectorizing the scheduler half, the worker's table handling and the
planner are in doc/transfer-engine.md.

Pieces (every one with the real classes of xinference/model/llm/vllm/xavier):

  sched.match      SchedulerSide.match for every request (the hit is kept: _keep)
  sched.alloc+step SchedulerSide.allocated for every request + build_step (LoadBatch)
  worker.table     WorkerDataPlane._load with engine.load_gpu_requests_v1 stubbed
                   (counters, ensure_mapped set, np.unique over (rank, tier), ...)
  eng.plan         GPUTransfer._plan (plan_step + _validate/check_plan/_fused_ok)
  eng.split        GPUTransfer._split
  eng.launch       GPUTransfer._launch with _run patched to a no-op (index arrays,
                   IndexUploader.upload on CPU = torch.from_numpy)
  eng.load_v1      load_gpu_requests_v1 whole (with _run no-op), completion thread idle
  worker.load      WorkerDataPlane._load whole (real engine, _run no-op) -- the analogue
                   of the worker's load_launch_cpu_us
  compl.check      LoadCompletion._check_reads over every transfer (all reads hold)
  compl.complete   LoadCompletion._complete (check + the summary: sets of dst_blocks)

The copies are excluded by setting the engine instance's ``_run`` to a no-op (on a CPU
engine ``_launch`` calls ``self._run`` synchronously; nothing else copies bytes on the
step's thread: no background transfers exist, every storage is a CPU tensor).
Mapped storages carry SlotGenerations whose values equal the table's gen/inc, so the
read checks take the all-ok path.  Timings: median of --reps, perf_counter and
thread_time (CPU) in microseconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import inspect
import os
import pstats
import statistics
import sys
import sysconfig
import time
from typing import Any, Callable, Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PKG_DIR = os.path.join(REPO, "xinference/model/llm/vllm/xavier")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from xinference.model.llm.vllm.xavier.mechanism.load_handle import LoadHandle, LoadJob  # noqa
from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations  # noqa
from xinference.model.llm.vllm.xavier.planning.block_directory import QueryResult  # noqa
from xinference.model.llm.vllm.xavier.planning.directory_types import Location  # noqa
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier  # noqa
from xinference.model.llm.vllm.xavier.planning.lookups import DirectoryLookups  # noqa
from xinference.model.llm.vllm.xavier.planning.options import XavierOptions  # noqa
from xinference.model.llm.vllm.xavier.planning.plan import plan_step  # noqa
from xinference.model.llm.vllm.xavier.planning.scheduler_side import SchedulerSide  # noqa
from xinference.model.llm.vllm.xavier.vllm_side.actor_bridge import ActorBridge  # noqa
from xinference.model.llm.vllm.xavier.vllm_side.worker_plane import WorkerDataPlane  # noqa

BS = 16
N_DEST = 16384  # engine blocks
N_SLOTS = 8192  # slots per source storage tier
# one block per layer: [2 (k/v), 16 tokens, 2 heads, 8] bf16 -- tiny: no copy is timed
BLOCK_SHAPE = (2, BS, 2, 8)
LAYERS = 4
SLAB_ROWS = 512  # XavierOptions.slab_blocks default


#: XAVIER_PROF_DEVICE=cuda puts every cache on the GPU (untested here: no GPU on the
#: profiling machine); --with-copies keeps the real _run (Triton / torch copies)
DEVICE = os.environ.get("XAVIER_PROF_DEVICE", "cpu")
WITH_COPIES = "--with-copies" in sys.argv


def caches(n: int) -> Dict[int, List[torch.Tensor]]:
    return {0: [torch.zeros((n, *BLOCK_SHAPE), dtype=torch.bfloat16, device=DEVICE)
                for _ in range(LAYERS)]}


class Scenario:
    """``n_req`` requests of ``blocks`` loaded blocks each; request i reads from rank
    ``ranks[i % R]`` and tier ``tiers[(i // R) % T]``."""

    def __init__(self, n_req: int, blocks: int, ranks: Tuple[int, ...],
                 tiers: Tuple[Tier, ...], seed: int = 0) -> None:
        self.n_req, self.blocks, self.ranks, self.tiers = n_req, blocks, ranks, tiers
        rng = np.random.default_rng(seed)
        total = n_req * blocks
        self.rows = total
        dests = rng.choice(np.arange(1, N_DEST), size=total + n_req, replace=False)
        # per (rank, tier) storage: its incarnation and its generations row
        self.incs = {(r, t): int(rng.integers(1, 2**62)) for r in ranks for t in tiers}
        self.gens = {(r, t): rng.integers(1, 2**40, size=N_SLOTS) for r in ranks for t in tiers}
        free = {(r, t): list(rng.permutation(N_SLOTS)) for r in ranks for t in tiers}
        self.requests = []  # (rid, names, locations, block_ids)
        for i in range(n_req):
            r, t = ranks[i % len(ranks)], tiers[(i // len(ranks)) % len(tiers)]
            names = [int(x) for x in rng.integers(1, 2**63 - 1, size=blocks + 1)]
            names = [n | (int(rng.integers(0, 2**63)) << 64) for n in names]  # 127-bit names
            locs = []
            for _ in range(blocks):
                slot = int(free[(r, t)].pop())
                locs.append(Location(r, int(t), 0, slot, int(self.gens[(r, t)][slot]),
                                     self.incs[(r, t)]))
            ids = [int(x) for x in dests[i * (blocks + 1):(i + 1) * (blocks + 1)]]
            self.requests.append((f"req-{i}", names, locs, ids))

    @property
    def label(self) -> str:
        return (f"{self.rows} rows ({self.n_req}x{self.blocks}), {len(self.ranks)} rank(s), "
                f"{'+'.join(t.name for t in self.tiers)}")


# ----------------------------------------------------------------- scheduler side
def matched_side(sc: Scenario) -> SchedulerSide:
    """A SchedulerSide that has tracked and matched every request (hits held)."""
    results = {rid: QueryResult(tuple(names[:sc.blocks]), tuple(locs),
                                tuple(range(1, sc.blocks + 1)))
               for rid, names, locs, _ in sc.requests}

    def send(batch):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result([results[rid] for rid, _ in batch])
        return fut

    def take_leases(locations):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(list(range(1, len(locations) + 1)))
        return fut

    side = SchedulerSide(0, BS, 1, DirectoryLookups(send), lambda ids: None,
                         take_leases=take_leases)
    for rid, names, _, _ in sc.requests:
        side.track(rid, (lambda n=names: n), (sc.blocks + 1) * BS)
    return side


def do_match(side: SchedulerSide, sc: Scenario) -> None:
    for rid, _, _, _ in sc.requests:
        got = side.match(rid, (sc.blocks + 1) * BS, 0)
        assert got == sc.blocks * BS, got


def do_alloc_step(side: SchedulerSide, sc: Scenario):
    for rid, _, _, ids in sc.requests:
        side.allocated(rid, [ids], [[False] * len(ids)], sc.blocks * BS)
    return side.build_step([(rid, sc.blocks * BS, BS) for rid, *_ in sc.requests], {})


# -------------------------------------------------------------------- worker side
def make_plane(sc: Scenario) -> Tuple[WorkerDataPlane, List[Any]]:
    base = {"rank": 0, "rank_address": "a", "block_tracker_address": "b",
            "block_tracker_uid": "t", "xavier_in_place": False}
    options = XavierOptions.from_xavier_config(base, {})
    local = caches(N_DEST)
    plane = WorkerDataPlane(options, ActorBridge.shared(),
                            {0: [(f"l{i}", t) for i, t in enumerate(local[0])]}, {0: 0})
    plane._attached = True
    plane.writer = object()  # type: ignore[assignment]  (only tested for None in _load)
    keep = []
    for r in sc.ranks:
        for t in sc.tiers:
            g = SlotGenerations.create({(int(t), 0): N_SLOTS})
            row = g.row(int(t), 0)
            row[:] = sc.gens[(r, t)]
            g._shm.words[1] = sc.incs[(r, t)]
            keep.append(g)
            plane.engine.map_storage(r, t, caches(N_SLOTS), 0, None, g)
    if not WITH_COPIES:
        plane.engine._run = lambda *a, **k: None  # no byte copies: host planning only
    return plane, keep


# ---------------------------------------------------------------------- timing
def timeit(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] = None,
           after: Callable[[Any], None] = None) -> Tuple[float, float]:
    walls, cpus = [], []
    for _ in range(reps + 3):
        arg = setup() if setup else None
        w, c = time.perf_counter(), time.thread_time()
        out = fn(arg) if setup else fn()
        c2, w2 = time.thread_time(), time.perf_counter()
        walls.append(w2 - w)
        cpus.append(c2 - c)
        if after:
            after(out)
    return 1e6 * statistics.median(walls[3:]), 1e6 * statistics.median(cpus[3:])


PROFILES: Dict[str, cProfile.Profile] = {}
PROFILE_CALLS: Dict[str, int] = {}


def profiled(name: str, fn: Callable[[], Any], reps: int, setup=None, after=None) -> None:
    prof = PROFILES.setdefault(name, cProfile.Profile())
    PROFILE_CALLS[name] = PROFILE_CALLS.get(name, 0) + reps
    for _ in range(reps):
        arg = setup() if setup else None
        prof.enable()
        out = fn(arg) if setup else fn()
        prof.disable()
        if after:
            after(out)


def run_scenario(sc: Scenario, reps: int, profile: bool) -> Dict[str, Tuple[float, float]]:
    res: Dict[str, Tuple[float, float]] = {}
    key = f"{sc.rows}r{len(sc.ranks)}k{len(sc.tiers)}t"

    def measure(name, fn, setup=None, after=None):
        res[name] = timeit(fn, reps, setup, after)
        if profile:
            profiled(f"{name} [{key}]", fn, max(5, reps // 3), setup, after)

    # (1) scheduler side
    measure("sched.match", lambda side: do_match(side, sc), setup=lambda: matched_side(sc))

    def matched():
        side = matched_side(sc)
        do_match(side, sc)
        return side

    measure("sched.alloc+step", lambda side: do_alloc_step(side, sc), setup=matched)
    meta = do_alloc_step(matched(), sc)
    assert meta.loads.num_rows == sc.rows, meta.loads.num_rows

    # (2)-(4) worker and engine
    plane, keep = make_plane(sc)
    eng = plane.engine
    real_load = eng.load_gpu_requests_v1
    # the working tree's _load(step, ordered_after) or HEAD's _load(step)
    two = len(inspect.signature(plane._load).parameters) == 2
    load = (lambda m: plane._load(m, None)) if two else plane._load

    def wait_pending(pending):
        for h in pending.handles:
            h.wait(30)

    eng.load_gpu_requests_v1 = lambda batch, *a: LoadHandle(batch.request_ids, {}, None, False)
    measure("worker.table", lambda: load(meta))
    eng.load_gpu_requests_v1 = real_load

    batch = meta.loads
    measure("eng.plan", lambda: eng._plan(batch))
    plan = eng._plan(batch)
    n_tr = len(plan.transfers)
    measure("eng.split", lambda: eng._split(plan))
    local, background = eng._split(plan)
    assert not background
    measure("eng.launch", lambda: eng._launch(local))
    measure("eng.load_v1", lambda: eng.load_gpu_requests_v1(batch), after=lambda h: h.wait(30))
    measure("worker.load", lambda: load(meta), after=wait_pending)

    comp = eng._completion
    reads = local + background
    assert not comp._check_reads(reads, {}, set()), "reads should all hold"
    measure("compl.check", lambda: comp._check_reads(reads, {}, set()))

    def job():
        h = LoadHandle(plan.request_ids, plan.written, None, True)
        return LoadJob(h, plan, None, [], None, reads)

    measure("compl.complete", lambda j: comp._complete(j), setup=job)
    res["_transfers"] = (n_tr, n_tr)
    plane.writer = None
    plane.close()
    for g in keep:
        g.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--only", default="", help="substring of a profile name to print")
    ap.add_argument("--with-copies", action="store_true", help="keep the real copies")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scenarios = [
        Scenario(8, 64, (1,), (Tier.GPU,)),
        Scenario(8, 64, (1, 2), (Tier.GPU, Tier.VLLM)),
        Scenario(1, 512, (1,), (Tier.GPU,)),
        Scenario(8, 512, (1,), (Tier.GPU,)),
        Scenario(8, 512, (1, 2), (Tier.GPU, Tier.VLLM)),
    ]
    results = []
    for sc in scenarios:
        results.append((sc, run_scenario(sc, args.reps, args.profile)))
    names = [k for k in results[0][1] if not k.startswith("_")]
    print("\nus per call, median: wall / thread CPU")
    print(f"{'piece':<20}" + "".join(f"{sc.label[:34]:>36}" for sc, _ in results))
    for n in names:
        print(f"{n:<20}" + "".join(f"{r[n][0]:>16.0f} / {r[n][1]:<17.0f}" for _, r in results))
    print(f"{'transfers':<20}" + "".join(f"{int(r['_transfers'][0]):>36}" for _, r in results))
    print(f"{'us/row worker.load':<20}" +
          "".join(f"{r['worker.load'][1] / sc.rows:>36.2f}" for sc, r in results))
    if args.profile:
        for name, prof in PROFILES.items():
            if args.only and args.only not in name:
                continue
            print_profile(name, prof, args.top)


def print_profile(name: str, prof: cProfile.Profile, top: int) -> None:
    """Top functions by own time and by cumulative time, in microseconds per profiled
    call of the piece (cProfile's overhead included: compare within a piece only)."""
    st = pstats.Stats(prof)
    calls = PROFILE_CALLS.get(name, 1)

    def where(k):
        f, line, fn = k
        f = f.replace(PKG_DIR + "/", "x/").replace(sysconfig.get_paths()["purelib"] + "/", "")
        return f"{f}:{line}({fn})" if line else fn

    rows = [(k, v) for k, v in st.stats.items()]
    for label, idx in (("own", 2), ("cum", 3)):
        print(f"\n===== {name}: top by {label} time, us per call (ncalls per call)")
        for k, v in sorted(rows, key=lambda kv: -kv[1][idx])[:top]:
            print(f"{1e6 * v[idx] / calls:9.1f} {v[1] / calls:8.1f}  {where(k)}")

if __name__ == "__main__":
    main()
