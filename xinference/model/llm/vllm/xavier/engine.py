"""``XavierEngine``: vLLM's ``AsyncLLM`` with the Xavier connector configured.

Xinference 3.5.0's ``VLLMModel.load`` calls
``XavierEngine.from_engine_args(engine_args, xavier_config=...)`` synchronously
and uses the result exactly like vLLM's async engine; after every rank is up,
the model actor awaits :meth:`XavierEngine.init_xavier`.

``from_engine_args``

1. validates the options (:class:`~.planning.options.XavierOptions`; errors name the option);
2. checks ``PYTHONHASHSEED`` (a user's fixed value is kept, ``random`` refused; unset, the
   engine core seeds vLLM's block hashes with the launch's secret seed:
   :mod:`~.planning.hash_seed`) and makes vLLM spawn its workers;
3. sets ``engine_args.kv_transfer_config`` to the Xavier connector
   (``kv_role="kv_both"``, ``kv_load_failure_policy="recompute"``, options in
   ``kv_connector_extra_config``) and keeps prefix caching on;
4. builds vLLM's engine.

Everything else stays as vLLM chooses it: async scheduling, the model runner vLLM picks
(Model Runner V2 where it is vLLM's default), CUDA graphs.  Loads are asynchronous in
vLLM's sense (``WAITING_FOR_REMOTE_KVS``), so a failed load is recomputed before the
request runs, whichever scheduler and runner are used.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional

from vllm.config import KVTransferConfig
from vllm.v1.engine.async_llm import AsyncLLM

from .planning.hash_seed import user_seed
from .planning.launch_checks import error_text
from .planning.log_names import package_logger, public_name
from .planning.options import XavierOptions, parse_quiet_ms

logger = package_logger(__name__)

CONNECTOR_NAME = "XavierConnector"
#: vLLM's processes import the connector by the name this package was loaded under: where it
#: is installed (the import overlay aliases the public name to it) that is
#: ``_xinference_xavier_fork``, the same module as the public path without upstream's
#: ``xinference/model/__init__.py``, which imports every model family of Xinference (~8 s of
#: CPU per engine process); from a source tree on ``PYTHONPATH`` with no overlay (namespace
#: packages, no install) it is the public ``xinference.model.llm.vllm.xavier``
CONNECTOR_MODULE = f"{__package__}.vllm_side.connector"
WORKER_EXTENSION = f"{__package__}.vllm_side.worker_extension.XavierWorkerExtension"


def xavier_kv_transfer_config(options: XavierOptions) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=options.to_extra_config())


def is_xavier_worker_extension(name: str) -> bool:
    """``name`` is Xavier's worker extension, under either of the package's names."""
    return public_name(name) == public_name(WORKER_EXTENSION)


def prepare_engine_args(engine_args: Any, xavier_config: Dict[str, Any],
                        environ: Optional[Dict[str, str]] = None) -> XavierOptions:
    """Validate and apply Xavier's settings to ``engine_args`` (in place)."""
    env = os.environ if environ is None else environ
    options = XavierOptions.from_xavier_config(xavier_config, env)
    check_gpu_budget(options, getattr(engine_args, "gpu_memory_utilization", None),
                     kv_cache_memory_bytes=getattr(engine_args, "kv_cache_memory_bytes", None))
    if getattr(engine_args, "kv_transfer_config", None) is not None:
        raise ValueError("kv_transfer_config: Xavier configures vLLM's KV connector itself; "
                         "do not pass kv_transfer_config together with enable_xavier")
    if getattr(engine_args, "enable_prefix_caching", None) is False:
        raise ValueError("enable_prefix_caching: Xavier shares prefix-cache blocks; it cannot "
                         "run with enable_prefix_caching=False")
    engine_args.enable_prefix_caching = True
    if user_seed(env) is not None:
        logger.info("xavier: replicas hash blocks with the user's PYTHONHASHSEED (a known "
                    "seed; unset, Xavier draws a secret one per launch)")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    keep_cpu_core_reservation(options, env)
    engine_args.kv_transfer_config = xavier_kv_transfer_config(options)
    asked = getattr(engine_args, "worker_extension_cls", "")
    if not asked or is_xavier_worker_extension(asked):
        engine_args.worker_extension_cls = WORKER_EXTENSION
    else:  # the user's extension stays; workers then attach at their next step instead
        logger.info("xavier: worker_extension_cls %r kept; init_xavier will not force the "
                    "attach", engine_args.worker_extension_cls)
    return options


#: vLLM's CPU build reserves one core (x86) for the engine-core process, and one more
#: whenever a KV connector is configured, "for nixl_connector under p/d case" (vLLM 0.27.1,
#: ``vllm/utils/ompmultiprocessing.py``).  On a host with few cores that second core is all
#: the worker's OpenMP threads had to themselves: with it taken, they spread over every core
#: and contend with the engine core on each step (measured on the 2-core CI machine: a
#: no-op connector serves ~30 % fewer tokens/s than no connector; reserving as vLLM does
#: without a connector brings it back)
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def keep_cpu_core_reservation(options: XavierOptions, env: Any,
                              cpu_x86: Optional[bool] = None) -> Optional[str]:
    """On vLLM's CPU build (x86), reserve the cores vLLM reserves with no KV connector (1)
    instead of one more for a NIXL connector in vLLM's workers (Xavier has none there: its
    NIXL endpoint, where used, lives in the rank's transfer actor) -- unless the user set
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``.  vLLM then logs that the value "is less than the
    minimum requirement: 2 cores" (its count with a connector).  Returns the value set, or
    None."""
    if RESERVED_CPU_ENV in env:
        return None
    if cpu_x86 is None:
        from vllm.platforms import CpuArchEnum, current_platform

        cpu_x86 = (current_platform.is_cpu()
                   and current_platform.get_cpu_architecture() == CpuArchEnum.X86)
    if not cpu_x86:
        return None
    env[RESERVED_CPU_ENV] = "1"
    logger.info("xavier: %s=1 (the core vLLM's CPU build reserves without a KV connector; "
                "it would reserve one more for a NIXL connector)", RESERVED_CPU_ENV)
    return "1"


def check_gpu_budget(options: XavierOptions, gpu_memory_utilization: Optional[float],
                     mem_get_info: Optional[Any] = None,
                     kv_cache_memory_bytes: Optional[int] = None) -> None:
    """The GPU tier is allocated next to vLLM on the same GPU, after vLLM took its share:
    ``gpu_memory_utilization`` of the GPU, or, where ``kv_cache_memory_bytes`` is set (vLLM
    then ignores the utilization), that many bytes of KV cache (its weights and activations
    come on top and are not known here).  The budget must fit in what is left."""
    if options.gpu_budget_bytes <= 0:
        return
    if mem_get_info is None:
        import torch

        if not torch.cuda.is_available():
            return  # no GPU here: the budget joins the shared-memory tier
        mem_get_info = torch.cuda.mem_get_info
    free, total = mem_get_info()
    if kv_cache_memory_bytes:
        left = int(free - int(kv_cache_memory_bytes))
        took = f"vLLM takes kv_cache_memory_bytes={int(kv_cache_memory_bytes)} plus its weights"
    else:
        util = 0.9 if gpu_memory_utilization is None else float(gpu_memory_utilization)
        left = int(free - util * total)
        took = f"vLLM takes gpu_memory_utilization={util} of {total}"
    if options.gpu_budget_bytes > left:
        raise ValueError(
            f"xavier_gpu_budget: {options.gpu_budget_bytes} bytes do not fit on the GPU next to "
            f"vLLM ({free} bytes free, {took}, leaving {max(left, 0)})")


class XavierEngine(AsyncLLM):
    """vLLM's ``AsyncLLM`` with Xavier's KV connector configured from Xinference's
    ``xavier_config`` (what Xinference 3.5.0 builds for ``enable_xavier``); ``init_xavier``
    attaches the workers once the rank's transfer actor exists."""
    xavier_options: XavierOptions

    @classmethod
    def from_engine_args(cls, engine_args: Any, *args: Any,  # type: ignore[override]
                         xavier_config: Optional[Dict[str, Any]] = None,
                         **kwargs: Any) -> XavierEngine:
        if xavier_config is None:
            raise ValueError("xavier_config: required (Xinference passes it with enable_xavier)")
        options = prepare_engine_args(engine_args, xavier_config)
        logger.info("xavier: starting vLLM engine for rank %d (GPU tier %d B, CPU tier %d B, "
                    "transport %s)", options.rank, options.gpu_budget_bytes,
                    options.cpu_budget_bytes, options.transport)
        engine = super().from_engine_args(engine_args, *args, **kwargs)
        assert isinstance(engine, XavierEngine)
        engine.xavier_options = options
        return engine

    async def init_xavier(self) -> bool:
        """Attach the workers' KV caches to the rank's transfer actor now (otherwise they
        attach on their own within a second of the next step)."""
        if not is_xavier_worker_extension(self.vllm_config.parallel_config.worker_extension_cls):
            logger.info("xavier: init_xavier: a user worker extension is set; workers attach "
                        "at their next step")
            return False
        # a refused registration (a budget that holds no block, ...) raises here and fails
        # the launch, naming the option
        try:
            results = await self.collective_rpc("xavier_attach")
        except Exception as exc:
            raise ValueError(error_text(str(exc))) from exc
        attached = all(bool(r) for r in (results or [False]))
        opts = self.xavier_options
        logger.info("xavier: rank %d init_xavier: workers attached=%s (GPU tier %d B, CPU tier "
                    "%d B, transport %s)", opts.rank, attached, opts.gpu_budget_bytes,
                    opts.cpu_budget_bytes, opts.transport)
        return attached

    async def set_batched_loads(self, batched: bool) -> None:
        """Switch the workers between one load call per step (``True``, the default) and
        one per request (the baseline of ``XAVIER_BATCHED_LOADS=0``) without a restart, so
        that both can be compared on the same warm engines."""
        await self.collective_rpc("xavier_set_batched_loads", args=(bool(batched),))
        self.xavier_options = dataclasses.replace(self.xavier_options, batched_loads=bool(batched))

    async def set_victim_saves(self, enabled: bool) -> None:
        """Let the workers copy (``True``, the default) or drop the victim saves the
        scheduler names (``xavier_save_victims``) without a restart: the serving benchmark's
        measure of what saves cost on the same warm engines (the scheduler still names and
        forgets the victims; dropped ones are simply not in Xavier's tiers)."""
        done = await self.collective_rpc("xavier_set_victim_saves", args=(bool(enabled),))
        if not all(done or [False]):  # a worker without a data plane: nothing was switched
            raise RuntimeError("xavier: set_victim_saves: a worker has no data plane")

    async def set_quiet_ms(self, quiet_ms: int) -> int:
        """Set ``xavier_quiet_ms`` (0 to 1000; refused otherwise, naming it) on every worker
        without a restart: the serving benchmark's measure of what the quiet gate changes,
        on the same warm engines (``batched-quiet0``).  Returns the spell before."""
        quiet_ms, before = parse_quiet_ms(quiet_ms), self.xavier_options.quiet_ms
        done = await self.collective_rpc("xavier_set_quiet_ms", args=(quiet_ms,))
        if not all(done or [False]):
            raise RuntimeError("xavier: set_quiet_ms: a worker has no attached data plane")
        self.xavier_options = dataclasses.replace(self.xavier_options, quiet_ms=quiet_ms)
        return before
