"""Real xoscar actor pools with sub pools in separate (spawned) processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Union

import xoscar as xo

from .engines import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def actor_pool(n_process: int = 1, scheme: str = "",
                     envs: Optional[Sequence[Dict[str, str]]] = None,
                     auto_recover: Union[str, bool] = "actor",
                     ) -> AsyncIterator[xo.MainActorPoolType]:
    """A main pool on loopback with ``n_process`` spawned sub pools; ``scheme="nixl"``
    makes every pool use xoscar's NIXL channel (``copy_to`` then moves bytes with NIXL);
    ``envs``: one environment per sub pool, set before anything runs there (Xinference
    gives each replica's sub pool its ``CUDA_VISIBLE_DEVICES`` this way);
    ``auto_recover``: xoscar's (its default ``"actor"`` restarts a dead sub pool with its
    actors created again; Xinference's worker pool uses ``"process"``: the process comes
    back, its actors do not)."""
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    prefix = f"{scheme}://" if scheme else ""
    pool = await xo.create_actor_pool(f"{prefix}127.0.0.1:{free_port()}", n_process=n_process,
                                      subprocess_start_method="spawn",
                                      envs=list(envs) if envs else None,
                                      auto_recover=auto_recover)
    try:
        yield pool
    finally:
        await pool.stop()


@contextlib.contextmanager
def actor_served(actor_cls: Any, uid: str, in_sub_pool: bool = False) -> Iterator[str]:
    """``actor_cls`` created under ``uid`` in a pool whose loop runs on a thread of this
    process (its main pool; ``in_sub_pool``: a spawned sub pool of it, so that every call
    from here crosses processes and is serialized); yields the actor's address."""
    ready, stop = threading.Event(), threading.Event()
    holder: Dict[str, str] = {}

    def serve() -> None:
        async def main() -> None:
            async with actor_pool(n_process=1 if in_sub_pool else 0) as pool:
                address = (sub_pool_addresses(pool)[0] if in_sub_pool
                           else pool.external_address)
                await xo.create_actor(actor_cls, address=address, uid=uid)
                holder["address"] = address
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        asyncio.run(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(120), f"the pool serving {uid} did not start"
    try:
        yield holder["address"]
    finally:
        stop.set()
        t.join(30)


def nixl_available() -> bool:
    """NIXL's Python API importable (xoscar's nixl channel needs it): the package's check."""
    from xinference.model.llm.vllm.xavier.mechanism.nixl_endpoint import nixl_importable

    return nixl_importable()


def sub_pool_addresses(pool: xo.MainActorPoolType) -> List[str]:
    """Addresses of the sub pools (index 0 is the main pool itself)."""
    return list(pool._config.get_external_addresses())[1:]


def gpu_envs(gpus: Optional[Sequence[str]], n_process: int
             ) -> Optional[List[Dict[str, str]]]:
    """One ``CUDA_VISIBLE_DEVICES`` environment per sub pool, or None (every sub pool sees
    every GPU).  ``gpus`` lists a device id per sub pool (``"-"``: leave that pool's
    environment alone); a shorter list is an error naming it."""
    if not gpus:
        return None
    if len(gpus) != n_process:
        raise ValueError(f"gpus: expected {n_process} device ids (one per sub pool), "
                         f"got {list(gpus)}")
    return [{} if g == "-" else {"CUDA_VISIBLE_DEVICES": g} for g in gpus]


def gpus_from_env() -> Optional[List[str]]:
    """``XAVIER_TEST_GPUS`` (e.g. ``"0,1"``): a GPU per replica in the GPU runs."""
    value = os.environ.get("XAVIER_TEST_GPUS", "")
    return [g.strip() for g in value.split(",")] if value.strip() else None
