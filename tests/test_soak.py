"""Soak (issue #8): 10,000 loads through the real load engine in its own process (directory,
exporting rank and loading rank in three xoscar sub pools, as in
``test_storage_multiprocess``).  Open file descriptors and RSS of the loading process are
sampled every 500 loads and printed; in the second half the descriptors must not change and
RSS must not grow by more than 8 MiB (a leak of one small object per load, e.g. a 1 KiB
buffer, would add ~5 MiB; a leaked mapping or slab far more).  Leases end at zero."""

import asyncio

import pytest

from .support.reliability import record
from .support.replica_actors import storage_world

pytestmark = pytest.mark.slow
LOADS, EVERY = 10_000, 500


def test_ten_thousand_loads_leave_fds_and_rss_flat():
    async def run():
        pool_cm, tracker, a, b = await storage_world(gpu_blocks=8, cpu_blocks=8)
        try:
            await a.export([(0, 100 + i, 10 + i) for i in range(4)])
            samples = await b.soak([100, 101, 102, 103], LOADS, EVERY)
            stats = await tracker.stats()
            await a.close()
            await b.close()
            return samples, stats
        finally:
            await pool_cm.__aexit__(None, None, None)

    samples, stats = asyncio.run(run())
    print(f"\n{'loads':>7} {'fds':>5} {'RSS MiB':>9}")
    for s in samples:
        print(f"{s['loads']:>7} {s['fds']:>5} {s['rss'] / 2**20:>9.1f}")
    half = [s for s in samples if s["loads"] >= LOADS // 2]
    fd_change = half[-1]["fds"] - half[0]["fds"]
    rss_growth = (half[-1]["rss"] - half[0]["rss"]) / 2**20
    leaks = int(fd_change != 0) + int(rss_growth > 8) + stats["outstanding_leases"]
    record("soak: 10k loads (loader process)", 0, 0, LOADS, leaks,
           f"2nd half: fds {half[0]['fds']}->{half[-1]['fds']}, "
           f"RSS {half[0]['rss'] / 2**20:.1f}->{half[-1]['rss'] / 2**20:.1f} MiB")
    assert fd_change == 0, samples
    assert rss_growth <= 8, samples
    assert stats["outstanding_leases"] == 0
