"""The scheduler half's host time for one request's life, piece by piece, on CPU (#33's
"nothing to share" row at C1).

    python benchmarks/scheduler_host_profile.py [--blocks 512] [--reps 20] [--profile]

On the H100 (session 34) Xavier's scheduler methods took 13 ms per 8K-token request at C1
with nothing to share (``scheduler_us`` / requests), on vLLM's critical path: the unique
row served 0.78x plain vLLM.  This replays what those methods do for one request of
``--blocks`` full blocks with the package's own classes (no vLLM, no directory): the
names of its blocks from vLLM's hashes, its lookup and the same-host probe, its prefill
step (newly full blocks published in place), its decode steps, and the step that hands
its blocks out again to the next request (victims, the peer-holding check, saves,
forgotten entries).  A same-host peer's host index holds half of the victims ("held
elsewhere") and once held the other half (so they are saved under the default policy),
as in the benchmark's steady state.  Timings: median of ``--reps``, microseconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import os
import pstats
import secrets
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from xinference.model.llm.vllm.xavier.mechanism.host_holders import HostHolders  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.host_index import HostIndex  # noqa: E402
from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations  # noqa
from xinference.model.llm.vllm.xavier.planning.block_names import block_name  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.in_place import InPlaceBook  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.load_batch import DEST, Tier  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.load_cost import LoadCost  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.lookups import DirectoryLookups  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.scheduler_side import SchedulerSide  # noqa: E402

BS = 16
NUM_BLOCKS = 65536  # the engine's vLLM cache
VLLM = int(Tier.VLLM)


class Peer:
    """A same-host peer's block generations and host index (as its worker writes them)."""

    def __init__(self, rank: int) -> None:
        self.gens = SlotGenerations.create_shared(VLLM, [0], NUM_BLOCKS)
        self.row = self.gens.row(VLLM, 0)
        self.index = HostIndex.create(rank, 0, self.gens, self.row)

    def close(self) -> None:
        self.index.close()
        self.gens.close()


def timed(fn: Callable[[], object], reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="cProfile one request's life")
    ap.add_argument("--whole-launch", action="store_true",
                    help="the peer's index is the whole launch's: a miss makes no lookup")
    a = ap.parse_args()
    n = a.blocks
    peer = Peer(rank=2)
    own = SlotGenerations.create_shared(VLLM, [0], NUM_BLOCKS)
    holders = HostHolders(own_rank=1, shards=InPlaceBookShards())
    holders.update([(2, 0, peer.index.path)], whole_launch=a.whole_launch)

    def miss(batch):  # the directory: nobody holds these (answered at once)
        from xinference.model.llm.vllm.xavier.planning.block_directory import QueryResult
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result([QueryResult((), np.zeros((0, 6), np.int64), np.zeros(0, np.int64))
                        for _ in batch])
        return fut

    figures: Dict[str, List[float]] = {}
    seq = [0]

    def life() -> Dict[str, float]:
        """One request's scheduler-side life; returns µs per piece."""
        seq[0] += 1
        rid = f"req-{seq[0]}"
        side = state["side"]
        book: InPlaceBook = state["book"]
        hashes = [secrets.token_bytes(32) for _ in range(n)]
        out: Dict[str, float] = {}
        t = time.perf_counter()
        names = [block_name(h) for h in hashes]
        out["names (block_name of vLLM's hashes)"] = time.perf_counter() - t
        t = time.perf_counter()
        side.track(rid, lambda: names, (n + 1) * BS, True, True, True)
        side.match(rid, (n + 1) * BS, 0)
        side.lookups.flush()
        side.match(rid, (n + 1) * BS, 0)
        out["track + match (host probe, lookup)"] = time.perf_counter() - t
        # two block ranges in turn: each life is handed the blocks the life before last
        # published (vLLM hands its oldest cached blocks out first), so it has n victims
        base = (seq[0] % 2) * (n + 1)
        ids = list(range(base, base + n + 1))
        t = time.perf_counter()
        book.handed_out(ids)  # the pool hands the request its blocks (victims: last life's)
        out["handed_out (pool hook)"] = time.perf_counter() - t
        t = time.perf_counter()
        side.allocated(rid, [ids], [[False] * len(ids)], 0)
        out["allocated"] = time.perf_counter() - t
        t = time.perf_counter()
        meta = side.build_step([(rid, 0, n * BS + 1)], {})
        out["build_step (prefill: exports)"] = time.perf_counter() - t
        t = time.perf_counter()
        meta.in_place = book.publish(meta.exports)
        book.loaded(meta.loads.table[:, DEST].tolist())
        saves = book.take_saves((), "shared", holders.holding)
        book.take_forgotten()
        out["in place: publish + saves + forgotten"] = time.perf_counter() - t
        out["  (victims saved)"] = len(saves.rows) * 1e-6
        # the peer publishes half of this request's blocks too (held there now), and held
        # the other half once (seen): next life's victims
        peer.index.insert([(0, nm, i, int(peer.row[i])) for i, nm in enumerate(names)])
        half = list(range(n // 2, n))
        peer.row[np.asarray(half)] += 1  # handed out there since
        peer.index.insert([(0, secrets.randbits(192), i, int(peer.row[i])) for i in half])
        t = time.perf_counter()
        for k in range(a.decodes):
            m = side.build_step([(rid, n * BS + 1 + k, 1)], {rid: ([[]], False)})
            book.publish(m.exports)
            book.take_saves((), "shared", holders.holding)
            book.take_forgotten()
        out["decode step (each)"] = (time.perf_counter() - t) / a.decodes
        t = time.perf_counter()
        side.finished(rid)
        out["finished"] = time.perf_counter() - t
        return {k: 1e6 * v for k, v in out.items()}

    state: Dict[str, object] = {}
    state["side"] = SchedulerSide(1, BS, 1, DirectoryLookups(miss), lambda ids: None,
                                  cost=LoadCost(lag=1), decline=True, on_host=holders.find,
                                  publish_loaded=True)
    state["book"] = InPlaceBook([own.row(VLLM, 0)], state["side"].shards)
    for _ in range(3):
        life()  # warm
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.reps):
            life()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    for _ in range(a.reps):
        for k, v in life().items():
            figures.setdefault(k, []).append(v)
    total = 0.0
    print(f"one request of {n} blocks, {a.decodes} decode steps (median of {a.reps}, µs):")
    for k, v in figures.items():
        med = statistics.median(v)
        if k.startswith("  "):
            print(f"  {k.strip():40s} {med:10.0f}")
            continue
        share = med * (a.decodes if k.startswith("decode") else 1)
        total += share
        print(f"  {k:40s} {med:10.1f}")
    print(f"  {'the life, total':40s} {total:10.0f}")
    holders.close()
    peer.close()
    own.close()
    return 0


def InPlaceBookShards():  # noqa: N802 (one group, TP 1)
    from xinference.model.llm.vllm.xavier.planning.shards import Shards
    return Shards(1, 1)


if __name__ == "__main__":
    sys.exit(main())
