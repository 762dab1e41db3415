"""``XavierConnector``: the vLLM V1 KV connector (adapter; loaded by ``kv_connector_module_path``).

Supported: vLLM 0.26.x (GPU) and 0.27.x (CPU build), whose connector API is the
same (checked method by method); later versions load with a warning.  The
module imports only names that exist in both; nothing version-specific is
used without a guard.

Like vLLM's ``NixlConnector``, the class vLLM instantiates is a thin front: each role's
work is a class of its own, and every overridden method states its contract here.

Scheduler role (engine core, :class:`~.connector_scheduler.XavierConnectorScheduler`). A
request's directory lookup leaves when the request arrives (``on_new_request``), batched
with the others of that moment; the answer is usually there when vLLM asks
(``get_num_new_matched_tokens``), which otherwise waits a bounded time and then answers
``None`` (ask again next step). Loads are asynchronous in vLLM's sense: a hit returns
``(tokens, True)``, vLLM allocates the blocks and keeps the request in
``WAITING_FOR_REMOTE_KVS`` (it is not computed) until the worker reports its load finished
through ``get_finished``; failed blocks are reported no later than that, through
``get_block_ids_with_load_errors``, and vLLM recomputes from the first of them before the
request runs. So a failed load costs a recompute, also with vLLM's async scheduling and its
Model Runner V2, and the forward never reads a block being loaded.

Worker role (:class:`~.connector_worker.XavierConnectorWorker`):
:class:`~.worker_plane.WorkerDataPlane` moves the bytes inside the worker process: ONE
``load_gpu_requests_v1`` per step with every request's loads, launched on its own CUDA
stream (``start_load_kv``); the copies are ordered before vLLM's next forward with CUDA
events when vLLM is told they are done (``get_finished``), and the step's newly full blocks
are exported after its forward without waiting (``wait_for_save``). Until the rank's
``TransferActor`` exists (it is created after the engine starts) and the worker has attached
to it, nothing is loaded or exported and the engine serves as without Xavier.

A request can opt out with ``kv_transfer_params={"xavier": false}`` (in
``SamplingParams.extra_args``): no lookup, no export.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ..planning.launch_checks import prefix_hash_problem
from ..planning.log_names import PUBLIC_PACKAGE, package_logger
from ..planning.options import XavierOptions
from ..planning.step_meta import StepMeta
from . import step_trace
from .actor_bridge import ActorBridge
from .connector_scheduler import XavierConnectorScheduler
from .connector_stats import XavierKVConnectorStats
from .connector_worker import XavierConnectorWorker, vllm_defers_block_frees
from .hybrid_failures import install as install_hybrid_recompute
from .hybrid_failures import windowed
from .parent_watch import watch_parent

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = package_logger(__name__)

SUPPORTED_VLLM = ("0.26.", "0.27.")


def _configure_logging() -> None:
    """``XAVIER_LOG_LEVEL`` (e.g. ``INFO``, ``DEBUG``): the package's own log lines in vLLM's
    processes too (by default only warnings reach their stderr)."""
    level = os.environ.get("XAVIER_LOG_LEVEL")
    if not level:
        return
    pkg = logging.getLogger(PUBLIC_PACKAGE)
    pkg.setLevel(level.upper())
    if not pkg.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        pkg.addHandler(handler)


_configure_logging()
_switch_interval_set = False


def apply_switch_interval(us: int) -> None:
    """Once per vLLM process: Python's GIL switch interval to ``us`` µs (0 keeps Python's).

    Xavier's threads in the engine processes (demotions, publications, lookups, lease
    releases) run Python; at Python's 5 ms a step waiting for the GIL behind one of them
    can wait that long.  Measured on the H200 both ways in two runs (doc/benchmarks.md,
    "The GIL"): sharing rows +0.3 to +9 % tokens/s and +6 to +8 points of hits at C8;
    sharing-off rows within the machine's noise."""
    global _switch_interval_set
    if _switch_interval_set or us <= 0:
        return
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(us / 1e6)
    _switch_interval_set = True
    logger.info("xavier: GIL switch interval %d us in this vLLM process (was %.0f us; "
                "xavier_switch_interval_us=0 keeps Python's)", us, before * 1e6)


if not vllm.__version__.startswith(SUPPORTED_VLLM):  # pragma: no cover - version guard
    logger.warning("xavier: vLLM %s is not a tested version (%s); the connector API may differ",
                   vllm.__version__, ", ".join(v + "x" for v in SUPPORTED_VLLM))


class XavierConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`~..planning.step_meta.StepMeta`, as vLLM carries it from the
    scheduler to the worker (pickled once per step)."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step


def sharing_problem(groups: List[Any], block_size: int, tensor_parallel: int = 1,
                    pipeline_parallel: int = 1, hash_algo: Optional[str] = None,
                    prefix_match_unit: Optional[int] = None) -> Optional[str]:
    """Why the engine's KV caches cannot be shared, or None.  Shared: attention caches
    (full, sliding-window, chunked-local; several groups with vLLM's hybrid KV-cache
    manager) of one block size, held by one worker or split over the workers of a
    tensor-parallel replica (each stores and loads its own shard, :mod:`..planning.
    shards`).  Not shared: state caches (Mamba-style SSM layers: a request's state is not
    a sequence of per-token blocks), encoder and cross-attention caches, and
    pipeline-parallel replicas (a stage holds some layers of every block: not built), nor
    blocks named by a non-cryptographic prefix hash (``hash_algo``, vLLM's
    ``prefix_caching_hash_algo``: xxhash), nor prefix hashes finer than a block (vLLM's
    ``prefix_match_unit``: its hashes then name parts of blocks, and vLLM copies partial
    hits into fresh blocks on its own stream)."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
    )

    hash_problem = prefix_hash_problem(hash_algo)
    if hash_problem is not None:
        return hash_problem
    if prefix_match_unit is not None and int(prefix_match_unit) != block_size:
        return (f"prefix_match_unit={prefix_match_unit}: Xavier shares whole blocks named "
                f"by vLLM's block hashes (prefix_match_unit unset or {block_size})")
    if pipeline_parallel > 1:
        return (f"pipeline_parallel_size={pipeline_parallel}: Xavier shares the KV of "
                "replicas without pipeline parallelism only (tensor parallelism is "
                "supported)")

    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if sizes and sizes != {block_size}:
        return (f"KV-cache groups with block sizes {sorted(sizes)} (scheduler block size "
                f"{block_size}) are not supported")
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
        for one in specs:
            if (not isinstance(one, AttentionSpec)
                    or isinstance(one, (CrossAttentionSpec, EncoderOnlyAttentionSpec))):
                return (f"KV-cache group {g} holds {type(one).__name__} layers: only "
                        "attention KV caches (full, sliding-window, chunked-local) are "
                        "shared")
    return None


class XavierConnector(KVConnectorBase_V1, SupportsHMA):
    """Cross-replica prefix KV sharing for Xinference (see the module docstring).

    vLLM builds one per role: the scheduler's holds a :class:`XavierConnectorScheduler`,
    each worker's a :class:`XavierConnectorWorker`.  ``disabled`` (a reason) turns the
    connector into a no-op for the engine's life: it serves as without Xavier.

    Supports vLLM's hybrid KV-cache manager (``SupportsHMA``): with Xavier on, a model
    mixing sliding-window and full attention keeps vLLM's per-group KV memory; loads and
    exports are per group and never touch a null block (a sliding-window block outside
    the window).  On such an engine vLLM's recompute of a failed load is made to read
    every group (:mod:`.hybrid_failures`); where that cannot be done, sharing is off."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Optional[KVCacheConfig] = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self.options = XavierOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        apply_switch_interval(self.options.switch_interval_us)
        bridge = ActorBridge.shared()
        watch_parent()  # engine core and worker: never outlive a killed replica process
        groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
        self.disabled: Optional[str] = None
        parallel = vllm_config.parallel_config
        tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        problem = sharing_problem(groups, self.block_size, tp_size,
                                  int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
                                  getattr(vllm_config.cache_config,
                                          "prefix_caching_hash_algo", None),
                                  getattr(vllm_config.cache_config, "prefix_match_unit", None))
        if (problem is None and (len(groups) > 1 or windowed(groups))
                and role == KVConnectorRole.SCHEDULER):
            why = install_hybrid_recompute()
            if why is not None:
                problem = (f"{len(groups)} KV-cache group(s) with null blocks, and a failed "
                           f"load could not be recomputed by vLLM: {why}")
        if problem is not None:
            self._disable(problem)
        self.scheduler: Optional[XavierConnectorScheduler] = None
        self.worker: Optional[XavierConnectorWorker] = None
        overlapped = int(getattr(vllm_config, "max_concurrent_batches", 2)) > 1
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = XavierConnectorScheduler(
                self.options, self.block_size, len(groups), bridge, tp_size, overlapped,
                getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None))
        else:
            num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
            self.worker = XavierConnectorWorker(
                self.options, bridge, [list(g.layer_names) for g in groups], num_blocks,
                tp_size, vllm_defers_block_frees(vllm_config), overlapped)
        logger.info("xavier: connector (%s) for rank %d, block size %d, tensor parallel %d",
                    role.name, self.options.rank, self.block_size, tp_size)
        step_trace.install(self, self.options.rank, role.name)  # XAVIER_STEP_TRACE only

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        logger.warning("xavier: sharing disabled: %s", reason)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache (vLLM 0.27): a dropped export is only a later miss."""
        return False

    @property
    def plane(self) -> Any:
        """The worker's :class:`~.worker_plane.WorkerDataPlane` (``None`` on the scheduler
        or before the caches are registered)."""
        return self.worker.plane if self.worker is not None else None

    # ================================================================ scheduler
    def on_new_request(self, request: Request) -> None:
        """vLLM added ``request`` to the scheduler.

        May: start the request's directory lookup (sent with the others of this moment,
        never waited for here; the answer holds no lease).  Must not block the scheduler
        loop.  The
        first request also checks that vLLM seeded its block hashes with the launch's
        secret seed (:mod:`.none_hash`); if not, sharing is off for the engine."""
        if self.scheduler is None or self.disabled:
            return
        problem = self.scheduler.seed_problem()
        if problem is not None:
            self._disable(problem)
            return
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the ``num_computed_tokens`` of the local prefix cache that other
        replicas hold, to be loaded asynchronously: ``(n, n > 0)``; ``(None, False)`` while
        the request's lookup is still out (vLLM asks again next step).

        Not side-effect free, unlike what vLLM suggests: the request's hit is kept until
        :meth:`update_state_after_alloc` binds it to blocks (no source slot is leased
        before the step that loads it); asking again for the same request and the same
        local hit gives the same answer without a new lookup.  Waits for the directory at
        most a bounded time per step (``planning.lookups``)."""
        assert self.scheduler is not None
        if self.disabled:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """vLLM allocated ``blocks`` for the request.

        The hit's destinations are the blocks at its positions (null blocks get no load);
        with ``num_external_tokens == 0`` (no load, or vLLM's second call after an async
        load) nothing is loaded.  Does not modify ``blocks``."""
        assert self.scheduler is not None
        if self.disabled:
            return
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """ONE :class:`~..planning.step_meta.StepMeta` for the step.

        Carries every load allocated since the last step (no lease: the scheduler half
        keeps them until :meth:`update_connector_output` reports the load done), the newly
        full blocks the step's forward computes (to export) and
        the step's figures.  Resets the scheduler half's per-step state; does not modify
        ``scheduler_output``."""
        assert self.scheduler is not None
        if self.disabled:
            return XavierConnectorMetadata(StepMeta())
        return XavierConnectorMetadata(self.scheduler.build_step(scheduler_output))

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool, once the scheduler's KV-cache manager exists.

        With ``xavier_in_place`` (the default) Xavier watches where the pool hands blocks
        out to be written (:mod:`.pool_watch`): each such block's generation is bumped
        before vLLM sees it, so that a peer reading the block in place detects the
        overwrite after its copy.  Changes no block, no count and no order of vLLM's."""
        if self.scheduler is not None and not self.disabled:
            self.scheduler.bind_pool(gpu_block_pool)

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's aggregation of every worker's output of a step (``KVConnectorOutput``),
        before the scheduler acts on it.

        ``finished_recving`` lists the requests whose loads every worker reported done
        through :meth:`get_finished` -- after the load's copies completed and its reads were
        checked (a load whose launch failed: at once, every destination failed): the
        leases of those loads are released here, the one place a lease is released after
        a load.  Changes nothing of ``connector_output``."""
        if self.scheduler is not None and not self.disabled:
            self.scheduler.loads_finished(connector_output.finished_recving or ())

    def request_finished(self, request: Request,
                         block_ids: List[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request is done or aborted: its tracking and any lease it still holds (a
        lookup, an unallocated hit) go; the leases of a load in flight stay until
        :meth:`update_connector_output` reports it done.

        Returns ``(False, None)``: blocks are never held back and nothing is sent
        asynchronously.  An aborted request whose load is in flight keeps its blocks until
        the worker reports the load finished, which vLLM itself waits for."""
        if self.scheduler is not None:
            self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV-cache manager's :meth:`request_finished` (``block_ids`` per
        KV-cache group): the same contract, ``(False, None)``."""
        return self.request_finished(request, [])

    # =================================================================== worker
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """vLLM's KV caches of this worker, once, before the first step.

        Grouped per KV-cache group with their block dimension; the data plane attaches to
        the transfer actor when it exists (now, at ``init_xavier``, or within a second of
        a later step).  Caches that cannot be shared disable the connector (logged); the
        engine serves on.  Never copies or frees vLLM's tensors."""
        if self.disabled or self.worker is None:
            return
        reason = self.worker.register_kv_caches(kv_caches)
        if reason is not None:
            self._disable(reason)

    def _step(self) -> Optional[StepMeta]:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.step if isinstance(meta, XavierConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Save the published blocks vLLM handed out this step into Xavier's tier (queued
        before anything of the step can write them), then launch the step's loads (one
        batched call) on the data plane's stream.

        Must not wait for them: the requests they serve are not in this step's forward
        (vLLM keeps them in ``WAITING_FOR_REMOTE_KVS``).  Without a data plane every load
        of the step is reported failed (vLLM recomputes)."""
        if self.worker is None:
            return
        step = self._step()
        if self.disabled:
            self.worker.fail_loads(step)
            return
        self.worker.start_loads(step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loaded requests are not in the forward that calls this."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing per layer: exports happen per step in :meth:`wait_for_save`."""
        return None

    def wait_for_save(self) -> None:
        """After the forward: publish the step's newly full blocks.

        In place (the default): no copy; the blocks are registered in the block directory
        as this engine's own once the forward's event completed.  Otherwise exported:
        queued after the forward on the copy stream, vLLM's stream made to wait for the
        copies (no block is reused before it was read), published once the bytes landed.
        Never waits on the host (a full storage tier skips the export)."""
        if self.worker is None or self.disabled:
            return
        self.worker.export(self._step())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """``(None, loads done)``: requests whose loads vLLM may consider complete.

        Each loaded request is reported exactly once, failed or not (its failed blocks
        come through :meth:`get_block_ids_with_load_errors` in the same pass); vLLM's
        stream is first made to wait for their copies.  In a step with no forward it waits
        a few milliseconds for a load in flight to finish (vLLM would only go round again).
        Nothing is ever sent asynchronously, so the first element is always ``None``."""
        if self.worker is None:
            return None, None
        step = self._step()
        return self.worker.finished_loads(idle=step is not None and step.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads reported finished whose bytes were not written; vLLM recomputes
        from the first of them.  Each block is reported once (the set is drained)."""
        if self.worker is None:
            return set()
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        """The worker's loads, exports and demotions since it last reported (vLLM sums
        them over workers and logs them as ``KV Transfer metrics``); None when nothing
        changed, and on the scheduler side (vLLM counts the external hits itself)."""
        if self.worker is None:
            return None
        return self.worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional[KVConnectorStats]:
        """vLLM's logger rebuilds the summed payload with this (see
        :mod:`.connector_stats`)."""
        return XavierKVConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """vLLM's connector shutdown (the worker's runs before its process frees the KV
        caches): loads and exports in flight finish, every storage mapping is let go,
        the transfer actor is told that the engine goes.  The scheduler's releases every
        lease it still holds.  Idempotent."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
