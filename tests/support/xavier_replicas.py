"""Two (or more) real vLLM replicas with Xavier, each in its own xoscar sub pool.

Mirrors what Xinference 3.5.0 does for a replica (see the contract note):
:class:`ReplicaActor` plays ``ModelActor`` (builds the engine with
``XavierEngine.from_engine_args`` in its sub pool, later creates the
``TransferActor`` next to itself and awaits ``init_xavier()``); the test process
plays the supervisor and hosts the ``VLLMBlockTracker``.  vLLM spawns its own
engine-core process under each sub pool.

Imported by the package's installed name (``_xinference_xavier_fork``: the same modules as
``xinference.model.llm.vllm.xavier.*``, see ``_xinference_xavier_overlay``), so that the
sub pools that unpickle these actors do not import upstream's ``xinference.model``
(~20 s of CPU per process on the 2-core machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple

import xoscar as xo

from _xinference_xavier_fork.block_tracker import VLLMBlockTracker

from .engines import EngineOptions, cpu_engine_env
from .pools import actor_pool, gpu_envs, sub_pool_addresses

MODEL_UID = "xavier-test"

#: what vLLM's stat loggers received as the connector's statistics in this process, summed
RECORDED_CONNECTOR_STATS: Dict[str, int] = {}


def _connector_stats_recorder() -> Any:
    """A vLLM stat logger (per-engine factory) that sums ``kv_connector_stats``: what vLLM's
    own logger would print as ``KV Transfer metrics``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ConnectorStatsRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            data = getattr(scheduler_stats, "kv_connector_stats", None) or {}
            for name, value in data.items():
                RECORDED_CONNECTOR_STATS[name] = RECORDED_CONNECTOR_STATS.get(name, 0) + value

        def log_engine_initialized(self) -> None:
            pass

    return ConnectorStatsRecorder


class ReplicaActor(xo.StatelessActor):
    """One replica: vLLM engine with Xavier + its transfer actor (same pool)."""

    def __init__(self, rank: int, opts: Dict[str, Any], xavier_config: Dict[str, Any],
                 env: Dict[str, str]) -> None:
        super().__init__()
        self.rank = rank
        self._opts = opts
        self._xavier_config = xavier_config
        self._env = env
        self.engine: Any = None
        self._transfer: Any = None

    async def __post_create__(self) -> None:
        os.environ.update(self._env)
        from vllm.engine.arg_utils import AsyncEngineArgs

        args = AsyncEngineArgs(**self._opts)
        if self._xavier_config.get("plain"):
            # what users have without Xavier: vLLM's AsyncLLM, no KV connector, its defaults
            from vllm.v1.engine.async_llm import AsyncLLM

            # only adds a method to the worker (its device memory, for the benchmarks' report)
            args.worker_extension_cls = (
                "_xinference_xavier_fork.vllm_side.device_memory.DeviceMemoryProbe")
            self.engine = AsyncLLM.from_engine_args(args)
            return
        from _xinference_xavier_fork.engine import XavierEngine

        self.engine = XavierEngine.from_engine_args(
            args, xavier_config=self._xavier_config, stat_loggers=[_connector_stats_recorder()])

    async def start_transfer(self, world_addresses: List[str]) -> bool:
        from _xinference_xavier_fork.transfer import TransferActor

        if self._xavier_config.get("plain"):
            return False
        self._transfer = await xo.create_actor(
            TransferActor, address=self.address, uid=f"{TransferActor.default_uid()}-{self.rank}",
            rank=self.rank, world_size=len(world_addresses),
            rank_address=self._xavier_config["rank_address"], store_address="127.0.0.1",
            store_port=0, world_addresses=world_addresses)
        return await self.engine.init_xavier()

    async def generate(self, prompts: Sequence[List[int]], max_tokens: int = 16,
                       xavier: bool = True, cache_salt: Optional[str] = None,
                       prompt_logprobs: Optional[int] = None) -> List[Dict[str, Any]]:
        """Greedy generation of all ``prompts`` concurrently (``cache_salt``: vLLM's tenant
        salt for each; ``prompt_logprobs``: vLLM's, returned as each prompt token's
        logprob, rounded).  Per request: token ids, the prompt tokens vLLM did not compute
        (local prefix cache + external loads), time to first token and latency (seconds,
        measured here, next to the engine)."""
        import time

        from vllm import SamplingParams

        extra = None if xavier else {"kv_transfer_params": {"xavier": False}}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                extra_args=extra, prompt_logprobs=prompt_logprobs)

        async def one(i: int, ids: List[int]) -> Dict[str, Any]:
            last = None
            first = None
            rid = f"r{self.rank}-{os.urandom(4).hex()}-{i}"
            t0 = time.perf_counter()
            prompt: Dict[str, Any] = {"prompt_token_ids": list(ids)}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            async for out in self.engine.generate(prompt, params, rid):
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                last = out
            assert last is not None
            logprobs = [None if lp is None else round(lp[t].logprob, 4)
                        for t, lp in zip(ids, last.prompt_logprobs or [])]
            return {"ids": list(last.outputs[0].token_ids),
                    "cached": int(last.num_cached_tokens or 0),
                    "prompt_logprobs": logprobs,
                    "ttft_s": first, "latency_s": time.perf_counter() - t0}

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async def engine_settings(self) -> Dict[str, Any]:
        """The vLLM settings that decide its speed, as the engine runs them."""
        cfg = self.engine.vllm_config
        return {"async_scheduling": bool(cfg.scheduler_config.async_scheduling),
                "model_runner_v2": bool(getattr(cfg, "use_v2_model_runner", False)),
                "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
                "enforce_eager": bool(cfg.model_config.enforce_eager),
                "hybrid_kv_cache_manager":
                    not cfg.scheduler_config.disable_hybrid_kv_cache_manager,
                "num_gpu_blocks": int(cfg.cache_config.num_gpu_blocks or 0),
                "kv_cache_dtype": str(cfg.cache_config.cache_dtype),
                "block_size": int(cfg.cache_config.block_size),
                "use_mla": bool(cfg.model_config.use_mla)}

    async def set_batched_loads(self, batched: bool) -> None:
        if not self._xavier_config.get("plain"):
            await self.engine.set_batched_loads(batched)

    async def set_victim_saves(self, enabled: bool) -> None:
        if not self._xavier_config.get("plain"):
            await self.engine.set_victim_saves(enabled)

    async def set_quiet_ms(self, quiet_ms: int) -> Optional[int]:
        """The workers' quiet spell; returns the one before (None on a plain replica)."""
        if self._xavier_config.get("plain"):
            return None
        return await self.engine.set_quiet_ms(quiet_ms)

    async def reset_prefix_cache(self) -> bool:
        """vLLM's reset of the local prefix cache; False when vLLM refused it (a request
        still holds blocks)."""
        return bool(await self.engine.reset_prefix_cache())

    async def counters(self) -> Dict[str, int]:
        return await self._transfer.counters() if self._transfer is not None else {}

    async def connector_stats(self) -> Dict[str, int]:
        """The connector statistics vLLM's stat loggers received so far (summed)."""
        return dict(RECORDED_CONNECTOR_STATS)

    async def metrics_text(self) -> str:
        return await self._transfer.metrics_text()

    async def hook(self, name: str, *args: Any) -> Any:
        """A test hook of the worker's data plane (``XAVIER_TEST_HOOKS=1``), through vLLM's
        ``collective_rpc`` (the first worker's answer)."""
        results = await self.engine.collective_rpc("xavier_hook", args=(name, *args))
        return results[0]

    async def hook_all(self, name: str, *args: Any) -> List[Any]:
        """:meth:`hook` on every worker of the replica (a tensor-parallel one has several),
        their answers in TP rank order."""
        return list(await self.engine.collective_rpc("xavier_hook", args=(name, *args)))

    async def flush(self) -> None:
        """Every launched load, export publication and lease release of the worker done."""
        await self.hook("flush")

    async def loaded_block_digests(self) -> Dict[Any, str]:
        return {(g, k): d for g, k, d in await self.hook("loaded_block_digests")}

    async def stored_block_digests(self, keys: List[Any]) -> Dict[Any, str]:
        # block names (192 bits) cross vLLM's collective_rpc (msgpack) as decimal text
        rows = await self.hook("stored_block_digests", [[g, str(k)] for g, k in keys])
        return {(g, int(k)): d for g, k, d in rows}

    async def reset_recent_loads(self) -> None:
        await self.hook("reset_recent")

    async def stored_vs_engine_mismatches(self) -> List[Any]:
        return [(g, int(k)) for g, k in await self.hook("stored_vs_engine_mismatches")]

    async def recorded_faults(self) -> List[Any]:
        return [tuple(x) for x in await self.hook("recorded_faults")]

    async def engine_block_is_zero(self, group: int, block_id: int) -> bool:
        return await self.hook("engine_block_is_zero", group, block_id)

    async def inject_fault(self, mode: str, count: int = 1) -> None:
        await self.hook("inject_fault", mode, count)

    async def raw_load(self, request_ids: Any, offsets: Any, table: Any) -> Dict[str, Any]:
        """One load with caller-made metadata (bad-input tests): request ids, offsets, an
        int64 table (any array-like)."""
        import numpy as np

        return await self.hook("raw_load", list(request_ids), np.asarray(offsets).tolist(),
                               np.asarray(table).tolist())

    async def engine_block_digests(self, group: int, block_ids: List[int]) -> List[str]:
        return await self.hook("engine_block_digests", group, block_ids)

    async def recent_export_keys(self) -> List[Any]:
        return [(g, int(k)) for g, k in await self.hook("recent_export_keys")]

    async def device_memory(self) -> List[Dict[str, int]]:
        """Each worker's device memory (``vllm_side/device_memory.py``), plain replicas too."""
        return list(await self.engine.collective_rpc("xavier_device_memory"))

    async def actor_device_memory(self) -> Dict[str, int]:
        """This actor's own process's device memory (the transfer actor lives here, and
        with it Xavier's GPU tier); zero when it never touched CUDA."""
        from _xinference_xavier_fork.vllm_side.device_memory import device_memory

        return device_memory(None)

    async def engine_num_blocks(self) -> int:
        return await self.hook("engine_num_blocks", 0)

    async def update_world(self, world_addresses: List[str]) -> None:
        await self._transfer.update_world(world_addresses)

    async def transfer_pid(self) -> int:
        return await self._transfer.pid()

    async def engine_pids(self) -> List[int]:
        """vLLM's engine-core processes of this replica (children of this sub pool)."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    async def transfer_ready(self) -> bool:
        return await self._transfer.is_ready()

    async def release_engine_as(self, owner: int) -> bool:
        return await self._transfer.release_engine(owner)

    async def stop_engine(self) -> None:
        """What Xinference's ``ModelActor.stop``/``__pre_destroy__`` do first: the model's
        ``stop()`` (vLLM's ``shutdown()``) in a thread; the transfer actor stays."""
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    async def generate_then_cancel(self, prompts: Sequence[List[int]], after_s: float,
                                   max_tokens: int = 64) -> int:
        """Start streaming ``prompts`` and cancel them all after ``after_s`` (vLLM aborts
        the requests).  Returns how many had finished by then."""
        task = asyncio.ensure_future(self.generate(prompts, max_tokens=max_tokens))
        done, _ = await asyncio.wait([task], timeout=after_s)
        if done:
            return len(prompts)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return 0

    async def __pre_destroy__(self) -> None:
        # Xinference 3.5.0's order: the model stops (in a thread), then the transfer actor goes
        await self.stop_engine()
        if self._transfer is not None:
            await xo.destroy_actor(self._transfer)
            self._transfer = None


@dataclass
class Replicas:
    tracker: Any
    replicas: List[Any]
    addresses: List[str]


@contextlib.asynccontextmanager
async def xavier_replicas(model_dir: str, n: int = 2, cpu_budget: str = "64MiB",
                          gpu_budget: object = 0,
                          engine: Optional[EngineOptions] = None,
                          sequential: bool = False,
                          extra_env: Optional[Dict[str, str]] = None,
                          gpus: Optional[Sequence[str]] = None,
                          transport: Optional[str] = None,
                          plain: bool = False,
                          cpu_binds: Optional[Sequence[str]] = None) -> AsyncIterator[Replicas]:
    """``n`` replicas (ranks 1..n; rank 0 is Xinference's coordinator and holds no engine).
    ``sequential``: start the engines one after the other (several engines on one GPU: vLLM's
    memory profiling of one must not see the other still starting).  ``gpus``: a CUDA
    device id per replica, given to its sub pool as ``CUDA_VISIBLE_DEVICES`` the way
    Xinference places replicas (each then sees one GPU, ``cuda:0``).  ``transport``: the
    launch's ``vllm_transfer_backend_type``.  ``plain``: replicas of vLLM's own
    ``AsyncLLM`` with no KV connector and vLLM's defaults (what users have without Xavier;
    the benchmarks' ``plain`` rows).  ``cpu_binds`` (vLLM's CPU build): each replica's
    ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``["0", "1"]``: a core of its own each; without it
    vLLM binds every replica of a host to the same cores)."""
    opts = engine or EngineOptions(model=model_dir)
    kwargs = opts.llm_kwargs()
    env = cpu_engine_env(extra_env)
    if cpu_binds is not None and len(cpu_binds) != n:
        raise ValueError(f"cpu_binds: expected {n} core lists (one per replica), "
                         f"got {list(cpu_binds)}")
    # (a killed replica's sub pool comes back without its actors, as in Xinference's worker
    # pool: xoscar's default would create the replica actor again and start an engine that
    # no test asked for, ~60 s of a test run, most of it in the world's teardown)
    async with actor_pool(n_process=n, envs=gpu_envs(gpus, n), auto_recover="process") as pool:
        tracker = await xo.create_actor(VLLMBlockTracker, address=pool.external_address,
                                        uid=f"{VLLMBlockTracker.default_uid()}-{MODEL_UID}")
        subs = sub_pool_addresses(pool)
        world = [pool.external_address] + subs[:n]
        replicas = []
        try:
            for rank in range(1, n + 1):
                cfg = {"block_tracker_uid": tracker.uid, "block_tracker_address": tracker.address,
                       "rank": rank, "world_size": n + 1, "rank_address": subs[rank - 1],
                       "store_address": "127.0.0.1", "store_port": 0, "transfer_block_num": 512,
                       "role": "hybrid", "vllm_transfer_backend_type": transport,
                       "xavier_gpu_budget": gpu_budget, "xavier_cpu_budget": cpu_budget,
                       "plain": plain}
                create = xo.create_actor(ReplicaActor, address=subs[rank - 1],
                                         uid=f"replica-{rank}", rank=rank, opts=kwargs,
                                         xavier_config=cfg,
                                         env=dict(env, VLLM_CPU_OMP_THREADS_BIND=(
                                             cpu_binds[rank - 1])) if cpu_binds else env)
                replicas.append(await create if sequential else create)
            if not sequential:
                replicas = list(await asyncio.gather(*replicas))
            await asyncio.gather(*(r.start_transfer(world) for r in replicas))
            yield Replicas(tracker, replicas, world)
        finally:
            for r in replicas:
                with contextlib.suppress(Exception):
                    await xo.destroy_actor(r)


def replicas_in_loop_thread(model_dir: str, **kwargs: Any) -> Iterator[Tuple[Any, Replicas]]:
    """For a module-scoped fixture: :func:`xavier_replicas` entered on a
    :class:`~.loop_thread.LoopThread` (so that one world serves several tests); yields
    ``(loop_thread, replicas)`` and tears both down."""
    from .loop_thread import LoopThread, enter, leave

    lt = LoopThread()
    cm = xavier_replicas(model_dir, **kwargs)
    replicas = lt.run(enter(cm))
    try:
        yield lt, replicas
    finally:
        lt.run(leave(cm))
        lt.stop()
