"""Summarize a py-spy profile taken with ``--threads --gil -f raw`` (``PYSPY_GIL=1``
in ``scripts/gpu-dataplane.sh``): which thread of each process with Xavier threads held
the GIL, and the innermost frames it held it in.

Usage: ``python3 scripts/pyspy_gil.py PROFILE.txt [RATE_HZ]``.  Each sample is one thread
holding its process's GIL at one tick, so samples / rate = seconds held."""

from __future__ import annotations

import collections
import re
import sys
from typing import Dict, Iterator, List, Tuple

FRAMES_SHOWN = 5
LEAVES_SHOWN = 8


def samples(path: str) -> Iterator[Tuple[str, str, List[str], int]]:
    """(process, thread name, frames outermost first, count) per line."""
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():  # a line cut short
                continue
            parts = stack.split(";")
            procs = [p for p in parts if p.startswith("process ")]
            thread = next((p for p in parts if p.startswith("thread (")), "thread (?): ?")
            frames = [p for p in parts if not p.startswith(("process ", "thread ("))]
            pid = procs[-1].split(":")[0] if procs else "process ?"
            name = thread.split(":", 1)[-1].strip() or "?"
            yield pid, re.sub(r"-\d+$", "", name), frames, int(count)


def main() -> int:
    path = sys.argv[1]
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 100.0
    per_thread: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: Dict[Tuple[str, str], collections.Counter] = collections.defaultdict(
        collections.Counter)
    for pid, thread, frames, n in samples(path):
        per_thread[pid][thread] += n
        leaves[(pid, thread)][" < ".join(reversed(frames[-FRAMES_SHOWN:]))[:400]] += n
    xavier = [pid for pid, threads in per_thread.items()
              if any(t.startswith("xavier-room") or t.startswith("xavier-publish")
                     for t in threads)]
    print(f"{path}: {len(per_thread)} processes, {len(xavier)} with Xavier's worker threads "
          f"(GIL samples at {rate:g} Hz; seconds = samples / rate)")
    for pid in sorted(xavier, key=lambda p: -sum(per_thread[p].values())):
        total = sum(per_thread[pid].values())
        print(f"\n{pid}: {total} samples holding the GIL ({total / rate:.1f} s)")
        for thread, n in per_thread[pid].most_common():
            print(f"  {n:>7} {100 * n / total:5.1f}%  {thread}")
        for thread, _ in per_thread[pid].most_common():
            print(f"\n  {pid} / {thread}: innermost frames")
            for frames, n in leaves[(pid, thread)].most_common(LEAVES_SHOWN):
                print(f"    {n:>6}  {frames}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
