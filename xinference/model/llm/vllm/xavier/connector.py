"""``XavierConnector``: the vLLM V1 KV connector (adapter; loaded by ``kv_connector_module_path``).

Supported: vLLM 0.26.x (GPU) and 0.27.x (CPU build), whose connector API is the
same (checked method by method); later versions load with a warning.  The
module imports only names that exist in both; nothing version-specific is
used without a guard.

Scheduler role (engine core): translates vLLM's requests and blocks for
:class:`~.scheduler_side.SchedulerSide`.  A request's directory lookup leaves when the
request arrives (``on_new_request``), batched with the others of that moment; the answer
is usually there when vLLM asks (``get_num_new_matched_tokens``), which otherwise waits
a bounded time and then answers ``None`` (ask again next step).  Loads are asynchronous
in vLLM's sense: a hit returns ``(tokens, True)``, vLLM allocates the blocks and keeps the
request in ``WAITING_FOR_REMOTE_KVS`` (it is not computed) until the worker reports its
load finished through ``get_finished``; failed blocks are reported no later than that,
through ``get_block_ids_with_load_errors``, and vLLM recomputes from the first of them
before the request runs.  So a failed load costs a recompute, also with vLLM's async
scheduling and its Model Runner V2, and the forward never reads a block being loaded.

Worker role: :class:`~.worker_plane.WorkerDataPlane` moves the bytes inside the worker
process: ONE ``load_gpu_requests_v1`` per step with every request's loads, launched on
its own CUDA stream (``start_load_kv``); the copies are ordered before vLLM's next
forward with CUDA events when vLLM is told they are done (``get_finished``), and the
step's newly full blocks are exported after its forward without waiting
(``wait_for_save``).  Until the rank's ``TransferActor`` exists (it is created after the
engine starts) and the worker has attached to it, nothing is loaded or exported and the
engine serves as without Xavier.

A request can opt out with ``kv_transfer_params={"xavier": false}`` (in
``SamplingParams.extra_args``): no lookup, no export.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .actor_bridge import ActorBridge, LazyActor
from .block_directory import QueryResult
from .counters import elapsed_us
from .kv_handles import group_layers
from .lease_release import BatchingReleaser, directory_sender
from .load_batch import DEST, fold_block_hash
from .lookups import DirectoryLookups
from .options import XavierOptions
from .parent_watch import watch_parent
from .scheduler_side import SchedulerSide, StepMeta
from .worker_plane import WorkerDataPlane

if TYPE_CHECKING:  # pragma: no cover
    import concurrent.futures

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.26.", "0.27.")
#: how often the scheduler side asks whether the worker attached (until it has)
READY_RECHECK_S = 0.5
READY_CALL_S = 2.0

def _configure_logging() -> None:
    """``XAVIER_LOG_LEVEL`` (e.g. ``INFO``, ``DEBUG``): the package's own log lines in vLLM's
    processes too (by default only warnings reach their stderr)."""
    level = os.environ.get("XAVIER_LOG_LEVEL")
    if not level:
        return
    pkg = logging.getLogger(__name__.rsplit(".", 1)[0])
    pkg.setLevel(level.upper())
    if not pkg.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        pkg.addHandler(handler)


_configure_logging()
if not vllm.__version__.startswith(SUPPORTED_VLLM):  # pragma: no cover - version guard
    logger.warning("xavier: vLLM %s is not a tested version (%s); the connector API may differ",
                   vllm.__version__, ", ".join(v + "x" for v in SUPPORTED_VLLM))


class XavierConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`~.scheduler_side.StepMeta`, as vLLM carries it to the worker."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step


def sharing_allowed(request: Request) -> bool:
    params = getattr(request, "kv_transfer_params", None) or {}
    value = params.get("xavier", True) if isinstance(params, dict) else True
    return value not in (False, "false", "off", 0)


class XavierConnector(KVConnectorBase_V1):
    """Cross-replica prefix KV sharing for Xinference (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Optional[KVCacheConfig] = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self.options = XavierOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._bridge = ActorBridge.shared()
        watch_parent()  # engine core and worker: never outlive a killed replica process
        groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
        self._group_layer_names = [list(g.layer_names) for g in groups]
        self._num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        self.disabled: Optional[str] = None
        sizes = {int(g.kv_cache_spec.block_size) for g in groups}
        if sizes and sizes != {self.block_size}:
            self.disabled = (f"KV-cache groups with block sizes {sorted(sizes)} (scheduler "
                             f"block size {self.block_size}) are not supported")
            logger.warning("xavier: sharing disabled: %s", self.disabled)
        # scheduler role
        self._side: Optional[SchedulerSide] = None
        self._ready = False
        self._next_ready_check = 0.0
        self._directory = LazyActor(self._bridge, self.options.block_tracker_address,
                                    self.options.block_tracker_uid, checked=False)
        if role == KVConnectorRole.SCHEDULER:
            releaser = BatchingReleaser(directory_sender(self._directory, self._bridge.start),
                                        self._bridge.schedule)
            lookups = DirectoryLookups(self._send_lookups, releaser.release_many)
            self._side = SchedulerSide(self.options.rank, self.block_size,
                                       max(1, len(groups)), lookups, releaser.release_many)
        # worker role
        self.plane: Optional[WorkerDataPlane] = None
        self._load_errors: Set[int] = set()
        self._tp_rank = 0
        self._device: Optional[torch.device] = None
        logger.info("xavier: connector (%s) for rank %d, block size %d", role.name,
                    self.options.rank, self.block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache (vLLM 0.27): a dropped export is only a later miss."""
        return False

    # ================================================================ scheduler
    def _send_lookups(self, batch: Sequence[Any]) -> concurrent.futures.Future[List[QueryResult]]:
        ref = self._directory.get()  # unchecked: a ref without a lookup
        groups = list(range(self._side.num_groups if self._side else 1))
        requests = [list(keys) for _, keys in batch]
        rank = self.options.rank
        return self._bridge.start(lambda: ref.query_many(groups, requests, rank))

    def _is_ready(self) -> bool:
        """Whether this rank's worker has attached to its transfer actor (the actor is
        created after the engine starts; until then no hit is offered).  Asked of the actor
        when a request arrives, at most every ``READY_RECHECK_S``, each ask bounded by
        ``READY_CALL_S``; once true it stays true."""
        if self._ready:
            return True
        now = time.monotonic()
        if now < self._next_ready_check:
            return False
        self._next_ready_check = now + READY_RECHECK_S
        try:
            self._ready = bool(self._bridge.call(self._probe_ready, timeout=READY_CALL_S))
        except Exception as exc:  # a pool still starting was seen not to answer at all
            logger.debug("xavier: transfer actor not ready: %r", exc)
        if self._ready:
            logger.info("xavier: rank %d: sharing is on (the worker attached)",
                        self.options.rank)
        return self._ready

    async def _probe_ready(self) -> bool:
        import xoscar as xo

        ref = await xo.actor_ref(self.options.rank_address, self.options.transfer_actor_uid)
        return bool(await ref.is_ready())

    def on_new_request(self, request: Request) -> None:
        """vLLM added ``request`` to the scheduler.  Starts its directory lookup (sent with
        the others of this moment, not waited for).  No lease is held for it yet beyond
        what the directory grants the lookup; they are released if the request goes."""
        if self._side is None or self.disabled:
            return
        with elapsed_us(self._side.add_time):
            self._side.track(request.request_id, _key_source(request), request.num_tokens,
                             sharing_allowed(request), self._is_ready())

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the ``num_computed_tokens`` of the local prefix cache that other
        replicas hold, to be loaded asynchronously: ``(n, n > 0)``; ``(None, False)`` while
        the request's lookup is still out (vLLM asks again next step).

        Not side-effect free, unlike what vLLM suggests: the answer holds leases on the
        source slots (so that no peer reuses them) until :meth:`update_state_after_alloc`
        hands them to a load or releases them; asking again for the same request and the
        same local hit gives the same answer without a new lookup.  Waits for the
        directory at most a bounded time per step (``lookups.DirectoryLookups``)."""
        assert self._side is not None
        if self.disabled:
            return 0, False
        with elapsed_us(self._side.add_time):
            ready = self._is_ready()
            self._side.track(request.request_id, _key_source(request), request.num_tokens,
                             sharing_allowed(request), ready)
            n = self._side.match(request.request_id, request.num_tokens, num_computed_tokens,
                                 ready)
        if n is None:
            return None, False
        return n, n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """vLLM allocated ``blocks`` for the request: the hit's destinations are the blocks
        at its positions (null blocks get no load; their leases travel along and are
        released with the others); with ``num_external_tokens == 0`` (no load, or vLLM's
        second call after an async load) nothing is loaded and held leases are released."""
        assert self._side is not None
        if self.disabled:
            return
        with elapsed_us(self._side.add_time):
            block_ids = blocks.get_block_ids()
            null = [[bool(b.is_null) for b in group] for group in blocks.blocks]
            self._side.allocated(request.request_id, block_ids, null, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """ONE :class:`StepMeta` for the step: every load allocated since the last step
        (the worker owns their leases from now on), the newly full blocks the step's
        forward computes (to export), the step's figures.  Does not modify
        ``scheduler_output``."""
        assert self._side is not None
        if self.disabled:
            return XavierConnectorMetadata(StepMeta())
        t0 = time.perf_counter()
        nst = scheduler_output.num_scheduled_tokens
        scheduled = [(r.req_id, int(r.num_computed_tokens), int(nst.get(r.req_id, 0)))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        new_blocks: Dict[str, Any] = {}
        for i, rid in enumerate(cached.req_ids):
            scheduled.append((rid, int(cached.num_computed_tokens[i]), int(nst.get(rid, 0))))
            new_blocks[rid] = (cached.new_block_ids[i], rid in resumed)
        self._side.add_time(int(1e6 * (time.perf_counter() - t0)))  # counted in this step
        return XavierConnectorMetadata(self._side.build_step(scheduled, new_blocks))

    def request_finished(self, request: Request,
                         block_ids: List[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request is done or aborted: its tracking and any lease it still holds (a
        lookup, an unallocated hit) go.  Blocks are never held back (``False``): an
        aborted request whose load is in flight keeps its blocks until the worker reports
        the load finished, which vLLM itself waits for."""
        if self._side is not None:
            self._side.finished(request.request_id)
        return False, None

    # =================================================================== worker
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """vLLM's KV caches of this worker: grouped per KV-cache group with their block
        dimension; the data plane attaches to the transfer actor when it exists (now, at
        ``init_xavier``, or within a second of a later step)."""
        if self.disabled:
            return
        try:
            groups, dims = group_layers(kv_caches, self._group_layer_names, self._num_blocks)
            self._device = groups[min(groups)][0][1].device
            self.plane = WorkerDataPlane(self.options, self._bridge, groups, dims)
        except Exception as exc:
            self.disabled = f"KV caches cannot be shared: {exc}"
            logger.warning("xavier: sharing disabled: %s", self.disabled)
            return
        self._tp_rank = _tp_rank()
        logger.info("xavier: rank %d KV caches registered (%d groups, %s)",
                    self.options.rank, len(groups), self._device)
        self.plane.attach()

    def _step(self) -> Optional[StepMeta]:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.step if isinstance(meta, XavierConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Launch the step's loads (one batched call) without waiting for them: the
        requests they serve are not in this step's forward."""
        step = self._step()
        plane = self.plane
        if step is None or plane is None or self.disabled:
            if step is not None and step.has_loads:  # no data plane: every load fails
                self._load_errors.update(int(b) for b in step.table[:, DEST])
            return
        if not plane.attached:
            plane.attach()
        if self._tp_rank == 0:  # the scheduler's figures, counted once per replica
            plane.add_step_stats(step.stats.as_dict())
        plane.load(step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loaded requests are not in the forward that calls this."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Exports happen per step in :meth:`wait_for_save`, not per layer."""
        return None

    def wait_for_save(self) -> None:
        """After the forward: export the step's newly full blocks.  Queued after the
        forward on the copy stream, vLLM's stream made to wait for the copies (no block
        is reused before it was read); never waits on the host.  Publication in the
        block directory follows once the bytes landed."""
        step = self._step()
        if step is None or not step.exports or self.plane is None or self.disabled:
            return
        self.plane.export(step.exports)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """``(None, loads done)``: requests whose loads vLLM may consider complete.  Each
        loaded request is reported exactly once, failed or not (its failed blocks come
        through :meth:`get_block_ids_with_load_errors` in the same pass); vLLM's stream is
        first made to wait for their copies.  Nothing is ever sent asynchronously."""
        if self.plane is None:
            return None, None
        stream = torch.cuda.current_stream(self._device) if (
            self._device is not None and self._device.type == "cuda") else None
        done, failed = self.plane.finished(stream)
        self._load_errors.update(failed)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads reported finished whose bytes were not written (vLLM recomputes
        from the first of them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """vLLM's connector shutdown (the worker's runs before its process frees the KV
        caches): loads and exports in flight finish, every storage mapping is let go,
        the transfer actor is told that the engine goes."""
        if self.plane is not None:
            self.plane.close()


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _key_source(request: Request) -> Any:
    """Folded directory keys of ``request``'s full blocks, computed incrementally."""
    cache: List[int] = []

    def keys() -> List[int]:
        hashes = request.block_hashes
        while len(cache) < len(hashes):
            cache.append(fold_block_hash(hashes[len(cache)]))
        return cache

    return keys


def _connector() -> Optional[XavierConnector]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector if isinstance(connector, XavierConnector) else None


class XavierWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``) so that the model actor reaches
    the worker's connector with ``collective_rpc``."""

    def xavier_attach(self) -> bool:
        connector = _connector()
        if connector is None or connector.plane is None:
            return False
        return bool(connector.plane.attach(force=True, raise_errors=True))

    def xavier_set_batched_loads(self, batched: bool) -> bool:
        """Set the worker's load mode (see ``XavierEngine.set_batched_loads``)."""
        connector = _connector()
        if connector is None or connector.plane is None:
            return False
        connector.plane.batched_loads = bool(batched)
        return True

    def xavier_hook(self, name: str, *args: Any) -> Any:
        """A test hook of the data plane (``XAVIER_TEST_HOOKS=1`` only)."""
        connector = _connector()
        if connector is None or connector.plane is None:
            raise RuntimeError("xavier: no data plane in this worker")
        hooks = connector.plane.hooks
        if hooks is None:
            raise RuntimeError("xavier: test hooks are off (XAVIER_TEST_HOOKS=1 is not set "
                               "in the engine's environment)")
        return getattr(hooks, name)(*args)
