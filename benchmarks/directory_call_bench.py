"""What a call to the directory actor costs the calling process (an engine's), by the form
of its bulk argument: a bare list (xoscar's serializer walks it item by item) or
:class:`~xinference.model.llm.vllm.xavier.planning.directory_types.Packed` (pickled whole).

    python benchmarks/directory_call_bench.py [--rows 512,94] [--calls 100] [--out FILE]

A ``VLLMBlockTracker`` in a sub pool (another process, as the supervisor is); from this
process, through the actor bridge as an engine calls it: a registration of ``--rows`` rows
(192-bit block names) as a list, and packed (``TrackerLink.register``); a lookup of as
many keys, both ways; and an empty call (``hash_seed``: the call's own cost).  Prints, per
call, this process's CPU time (every thread: what the call takes from the steps it runs
beside, under the GIL), the directory process's (what the call takes from the directory's
one actor) and the wall time; the mean of ``--calls`` calls, each form twice in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from tests.support.pools import actor_served  # noqa: E402
from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker  # noqa: E402
from xinference.model.llm.vllm.xavier.planning.directory_types import Packed  # noqa: E402
from xinference.model.llm.vllm.xavier.vllm_side.actor_bridge import ActorBridge, LazyActor  # noqa: E402
from xinference.model.llm.vllm.xavier.vllm_side.tracker_link import TrackerLink  # noqa: E402


def cpu_s(process: psutil.Process) -> float:
    t = process.cpu_times()
    return float(t.user + t.system)


def timed(calls: int, make: Callable[[int], Callable[[], Any]], directory: psutil.Process
          ) -> Dict[str, float]:
    work = [make(i) for i in range(calls)]  # arguments built before the clock starts
    c0, d0, w0 = time.process_time(), cpu_s(directory), time.perf_counter()
    for w in work:
        w()
    c1, d1, w1 = time.process_time(), cpu_s(directory), time.perf_counter()
    return {"cpu_ms": round(1e3 * (c1 - c0) / calls, 3),
            "directory_cpu_ms": round(1e3 * (d1 - d0) / calls, 3),
            "wall_ms": round(1e3 * (w1 - w0) / calls, 3)}


def forms(n: int, bridge: ActorBridge, ref: Any, link: TrackerLink
          ) -> Dict[str, Callable[[int], Callable[[], Any]]]:
    """Each form's maker: call ``i``'s arguments built, then the call to time."""
    def rows(i: int) -> List[Any]:
        return [(0, secrets.randbits(192), 1, (i * n + j) % 4096, i + 1) for j in range(n)]

    def register_list(i: int) -> Callable[[], Any]:
        r = rows(i)  # the link's old form: every row rebuilt of ints, sent as a list
        return lambda: bridge.call(lambda: ref.register(
            1, [tuple(int(x) for x in e) for e in r], 0))

    def register_packed(i: int) -> Callable[[], Any]:
        r = rows(i)
        return lambda: link.register(1, r, 0)

    def lookup(packed: bool) -> Callable[[int], Callable[[], Any]]:
        def make(i: int) -> Callable[[], Any]:
            keys = [secrets.randbits(192) for _ in range(n)]
            asked = Packed([keys]) if packed else [keys]
            return lambda: bridge.call(lambda: ref.query_many([0], asked, 2, False))
        return make

    return {"register, list": register_list, "register, packed": register_packed,
            "lookup, list": lookup(False), "lookup, packed": lookup(True),
            "empty call": lambda i: lambda: bridge.call(lambda: ref.hash_seed())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="512,94")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()
    with actor_served(VLLMBlockTracker, "tracker", in_sub_pool=True) as address:
        run(args, address)


def run(args: argparse.Namespace, address: str) -> None:
    bridge = ActorBridge.shared()
    tracker = LazyActor(bridge, address, "tracker", checked=False)
    ref, link = tracker.get(), TrackerLink(bridge, tracker)
    bridge.call(lambda: ref.register_rank(1, 1))
    [directory] = psutil.Process().children()  # the sub pool
    results: List[Dict[str, Any]] = []
    for n in [int(x) for x in args.rows.split(",")]:
        for rep in range(2):
            for name, make in forms(n, bridge, ref, link).items():
                got = timed(args.calls, make, directory)
                results.append(dict(rows=n, form=name, rep=rep, **got))
                print(f"{n:5d} rows  {name:18s} {got['cpu_ms']:7.3f} ms CPU here  "
                      f"{got['directory_cpu_ms']:7.3f} ms CPU in the directory's process  "
                      f"{got['wall_ms']:7.3f} ms wall", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls": args.calls, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
