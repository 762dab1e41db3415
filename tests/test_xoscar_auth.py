"""xoscar's opt-in frame authentication (``XOSCAR_AUTH_KEY``, xoscar 0.12.2) around
Xavier's own actors: a pool started with the key serves the block directory (and its secret
seed) to a client that has the key, and refuses one that has none or another -- the
negative control that shows the key is really checked.  Real processes: the pool in one,
each client in another (the key is read from the environment of each process)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POOL = r"""
import asyncio, socket, sys
import xoscar as xo
from _xinference_xavier_fork.block_tracker import VLLMBlockTracker

async def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = await xo.create_actor_pool(f"127.0.0.1:{port}", n_process=0)
    await xo.create_actor(VLLMBlockTracker, address=pool.external_address, uid="tracker-auth")
    print(pool.external_address, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""

CLIENT = r"""
import asyncio, sys
import xoscar as xo

async def main():
    ref = await xo.actor_ref(address=sys.argv[1], uid="tracker-auth")
    seed = await asyncio.wait_for(ref.hash_seed(), 20)
    print("SEED", len(seed), flush=True)

try:
    asyncio.run(main())
except BaseException as exc:
    print("REFUSED", type(exc).__name__, str(exc)[:200], flush=True)
"""


def env(key):
    out = dict(os.environ, PYTHONPATH=REPO)
    out.pop("XOSCAR_AUTH_KEY", None)
    if key:
        out["XOSCAR_AUTH_KEY"] = key
    return out


def client(address: str, key) -> str:
    out = subprocess.run([sys.executable, "-c", CLIENT, address], env=env(key),
                         capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("SEED", "REFUSED"))]
    assert lines, out.stderr[-2000:]
    return lines[-1]


def test_the_directory_answers_only_clients_with_the_cluster_key():
    pool = subprocess.Popen([sys.executable, "-c", POOL], env=env("cluster-key-1"),
                            stdout=subprocess.PIPE, text=True)
    try:
        address = pool.stdout.readline().strip()
        assert address, "the pool did not start"
        assert client(address, "cluster-key-1").startswith("SEED ")  # the launch's seed
        # no key, another key: the pool drops the connection at the first frame
        assert client(address, None).startswith("REFUSED ServerClosed")
        assert client(address, "another-key").startswith("REFUSED ServerClosed")
    finally:
        pool.kill()
        pool.wait(30)
