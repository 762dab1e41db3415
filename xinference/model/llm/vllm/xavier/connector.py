"""``XavierConnector``: the vLLM V1 KV connector (adapter; loaded by ``kv_connector_module_path``).

Supported: vLLM 0.26.x (GPU) and 0.27.x (CPU build), whose connector API is the
same (checked method by method); later versions load with a warning.  The
module imports only names that exist in both; nothing version-specific is
used without a guard.

Scheduler role (engine core): translates vLLM's requests and blocks for
:class:`~.scheduler_side.SchedulerSide` and asks the block directory
(``VLLMBlockTracker``) through :class:`~.actor_bridge.ActorBridge`.  Loads are
synchronous (``get_num_new_matched_tokens`` returns ``(tokens, False)``): the
worker writes them in ``start_load_kv`` before the step's forward.

Worker role: moves the KV caches into shareable memory and hands their
handles to the rank's ``TransferActor`` (found lazily: it is created after the
engine starts); per step, ONE ``load_gpu_requests_v1`` call with every
request's loads before the forward, and one export call with the newly full
blocks after it.  The export call is pipelined: it is sent after the forward and
awaited at the start of the next step (before that step's loads and forward), so the
actor's copy overlaps sampling and scheduling, and no block it reads can have been
freed, reallocated and written in between.  Blocks the actor could not write are returned by
``get_block_ids_with_load_errors`` so vLLM recomputes them (the engine is
built with ``kv_load_failure_policy="recompute"``).  Until the actor exists,
nothing is loaded or exported and the engine serves as without Xavier.

A request can opt out with ``kv_transfer_params={"xavier": false}`` (in
``SamplingParams.extra_args``): no query, no export.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from dataclasses import asdict
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
from .kv_handles import CacheHandles, group_layers, share
from .load_batch import DEST, fold_block_hash
from .options import XavierOptions
from .parent_watch import watch_parent
from .scheduler_side import SchedulerSide, StepMeta, StepStats

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.26.", "0.27.")
QUERY_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 300.0
#: how long a worker's shutdown waits for its transfer actor to let go of the KV caches
RELEASE_TIMEOUT_S = 5.0
READY_RECHECK_S = 0.5

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
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Optional[KVCacheConfig] = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self.options = XavierOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._bridge = ActorBridge.shared()
        watch_parent()  # engine core and worker: never outlive a killed replica process
        self._transfer = LazyActor(self._bridge, self.options.rank_address,
                                   self.options.transfer_actor_uid)
        self._directory = LazyActor(self._bridge, self.options.block_tracker_address,
                                    self.options.block_tracker_uid)
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
        if role == KVConnectorRole.SCHEDULER:
            self._side = SchedulerSide(self.options.rank, self.block_size,
                                       max(1, len(groups)), self._query, self._release)
        # worker role
        self._handles: Optional[CacheHandles] = None
        self._attached = False
        self._load_errors: Set[int] = set()
        self._pending_stats: Dict[str, int] = {}
        self._export_in_flight: Optional[concurrent.futures.Future[Any]] = None
        self.batched_loads = self.options.batched_loads  # switchable at run time
        self._device: Optional[torch.device] = None
        logger.info("xavier: connector (%s) for rank %d, block size %d", role.name,
                    self.options.rank, self.block_size)

    # ================================================================ scheduler
    def _query(self, group: int, keys: Sequence[int], exclude_rank: int) -> QueryResult:
        ref = self._directory.get()
        if ref is None:
            return QueryResult((), (), ())
        return self._bridge.call(lambda: ref.query(group, list(keys), exclude_rank),
                                 timeout=QUERY_TIMEOUT_S)

    def _release(self, lease_ids: Sequence[int]) -> None:
        ids = [int(x) for x in lease_ids]
        ref = self._directory.get(timeout=QUERY_TIMEOUT_S)
        if ids and ref is not None:
            self._bridge.submit(lambda: ref.release(ids), "lease release")

    def _transfer_ready(self) -> bool:
        """True once this rank's transfer actor has the engine's caches (asked at most
        once a second until then)."""
        if self._ready:
            return True
        now = time.monotonic()
        if now < self._next_ready_check:
            return False
        self._next_ready_check = now + READY_RECHECK_S
        ref = self._transfer.get()
        if ref is None:
            return False
        try:
            self._ready = bool(self._bridge.call(lambda: ref.is_ready(), timeout=QUERY_TIMEOUT_S))
        except Exception as exc:
            logger.debug("xavier: transfer actor not ready: %s", exc)
            self._transfer.forget()
        return self._ready

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._side is not None
        if self.disabled:
            return 0, False
        self._side.track(request.request_id, _key_source(request), sharing_allowed(request))
        ready = self._transfer_ready()
        return self._side.match(request.request_id, request.num_tokens, num_computed_tokens,
                                ready), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._side is not None
        if self.disabled:
            return
        block_ids = blocks.get_block_ids()
        null = [[bool(b.is_null) for b in group] for group in blocks.blocks]
        self._side.allocated(request.request_id, block_ids, null, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._side is not None
        if self.disabled:
            return XavierConnectorMetadata(StepMeta())
        nst = scheduler_output.num_scheduled_tokens
        scheduled = [(r.req_id, int(r.num_computed_tokens), int(nst.get(r.req_id, 0)))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        new_blocks: Dict[str, Any] = {}
        for i, rid in enumerate(cached.req_ids):
            scheduled.append((rid, int(cached.num_computed_tokens[i]), int(nst.get(rid, 0))))
            new_blocks[rid] = (cached.new_block_ids[i], rid in resumed)
        return XavierConnectorMetadata(self._side.build_step(scheduled, new_blocks))

    def request_finished(self, request: Request,
                         block_ids: List[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._side is not None:
            self._side.finished(request.request_id)
        return False, None

    # =================================================================== worker
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if self.disabled:
            return
        try:
            groups, dims = group_layers(kv_caches, self._group_layer_names, self._num_blocks)
            self._device = groups[min(groups)][0][1].device
            self._handles = share(groups, dims)
        except Exception as exc:
            self.disabled = f"KV caches cannot be shared: {exc}"
            logger.warning("xavier: sharing disabled: %s", self.disabled)
            return
        logger.info("xavier: rank %d KV caches ready to share (%d groups, %s)",
                    self.options.rank, len(groups), self._device)
        self.attach()

    def attach(self, force: bool = False, raise_errors: bool = False) -> bool:
        """Hand the caches to the transfer actor once it exists (at most once a second
        unless ``force``).  ``raise_errors``: a refused registration (e.g. a budget that
        holds no block) raises instead of being logged (``init_xavier`` fails the launch)."""
        if self._attached or self._handles is None:
            return self._attached
        if force:
            self._transfer.forget()
        ref = self._transfer.get(timeout=QUERY_TIMEOUT_S)
        if ref is None:
            return False
        handles, opts = self._handles, asdict(self.options)
        try:
            fingerprint = self._bridge.call(
                lambda: ref.register_engine(handles, opts, owner=os.getpid()),
                timeout=LOAD_TIMEOUT_S)
        except Exception as exc:
            logger.warning("xavier: rank %d: registering the KV caches failed: %s",
                           self.options.rank, exc)
            self._transfer.forget()
            if raise_errors:
                raise
            return False
        self._attached = True
        logger.info("xavier: rank %d attached to its transfer actor (layout %s)",
                    self.options.rank, fingerprint)
        return True

    def _step(self) -> Optional[StepMeta]:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.step if isinstance(meta, XavierConnectorMetadata) else None

    def _sync_device(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.settle_export()
        step = self._step()
        if step is None or self.disabled:
            return
        if not self._attached:
            self.attach()
        # the scheduler side's figures travel with the next load or export call
        for k, v in step.stats.as_dict().items():
            self._pending_stats[k] = self._pending_stats.get(k, 0) + v
        if not step.has_loads:
            return
        step.stats, self._pending_stats = StepStats(**self._pending_stats), {}
        ref = self._transfer.get() if self._attached else None
        if ref is None:
            self._fail_step(step, "transfer actor not attached")
            return
        self._sync_device()  # blocks vLLM zeroed or wrote must be settled before the copy
        calls = [step] if self.batched_loads else step.per_request()
        with elapsed_us(lambda us: self._count("worker_load_wait_us", us)):
            self._load_calls(ref, calls)

    def _count(self, name: str, us: int) -> None:
        """A worker-side time (µs) that rides to the actor with the next call."""
        self._pending_stats[name] = self._pending_stats.get(name, 0) + us

    def _load_calls(self, ref: Any, calls: Sequence[StepMeta]) -> None:
        for i, call in enumerate(calls):
            try:
                result = self._load_call(ref, call)
            except Exception as exc:
                self._attached = False
                self._transfer.forget()
                for rest in calls[i:]:
                    self._fail_step(rest, f"load call failed: {exc}")
                return
            failed = result.get("failed", [])
            if failed:
                logger.warning("xavier: rank %d: %d loaded blocks to recompute (%s)",
                               self.options.rank, len(failed), result.get("error", "partial"))
                self._load_errors.update(int(b) for b in failed)

    def _load_call(self, ref: Any, step: StepMeta) -> Dict[str, Any]:
        return self._bridge.call(lambda: ref.load_gpu_requests_v1(step), timeout=LOAD_TIMEOUT_S)

    def _fail_step(self, step: StepMeta, why: str) -> None:
        logger.warning("xavier: rank %d: step loads not done (%s): vLLM recomputes %d blocks",
                       self.options.rank, why, step.table.shape[0])
        self._load_errors.update(int(b) for b in step.table[:, DEST])
        self._release([lid for lid, _ in step.leases])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        step = self._step()
        if step is None or not step.exports or not self._attached or self.disabled:
            return
        if self._load_errors:
            # this step's forward read blocks that were not (fully) loaded: what it computed
            # may be wrong and must never be published; vLLM recomputes, later steps export
            logger.info("xavier: rank %d: %d exports of a step with failed loads skipped",
                        self.options.rank, len(step.exports))
            return
        ref = self._transfer.get()
        if ref is None:
            return
        self._sync_device()  # the forward's writes must be done before the copy
        self.settle_export()
        exports = list(step.exports)
        stats, self._pending_stats = self._pending_stats, {}
        self._export_in_flight = self._bridge.start(lambda: ref.export_blocks(exports, stats))

    def settle_export(self) -> None:
        """Wait for the export call sent after the previous forward.

        Contract: called before anything may write into the engine's KV cache again (this
        step's loads and forward), since a block the export reads may have been freed by a
        finished request and handed to a new one.  A failed export only loses a chance to
        share (nothing of it is published); it is logged, never raised.
        """
        fut, self._export_in_flight = self._export_in_flight, None
        if fut is None:
            return
        with elapsed_us(lambda us: self._count("worker_export_wait_us", us)):
            try:
                fut.result(LOAD_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                logger.warning("xavier: rank %d: export call did not finish within %s s",
                               self.options.rank, LOAD_TIMEOUT_S)
            except Exception as exc:
                logger.warning("xavier: rank %d: export failed: %s", self.options.rank, exc)

    def shutdown(self) -> None:
        """vLLM's connector shutdown (the worker's runs before its process frees the KV
        caches): let a last export finish, then have the transfer actor let go of this
        worker's caches (:meth:`TransferActor.release_engine`), so that the importer of
        the CUDA IPC mappings closes them before their owner exits.  Bounded by
        ``RELEASE_TIMEOUT_S``; a transfer actor that is gone or slow only gets logged."""
        self.settle_export()
        if not self._attached:
            return
        self._attached = False
        try:
            ref = self._transfer.get(timeout=RELEASE_TIMEOUT_S)
            if ref is not None:
                self._bridge.call(lambda: ref.release_engine(os.getpid()),
                                  timeout=RELEASE_TIMEOUT_S)
        except Exception as exc:
            logger.info("xavier: rank %d: releasing the KV caches at shutdown: %r",
                        self.options.rank, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _key_source(request: Request) -> Any:
    """Folded directory keys of ``request``'s full blocks, computed incrementally."""
    cache: List[int] = []

    def keys() -> List[int]:
        hashes = request.block_hashes
        while len(cache) < len(hashes):
            cache.append(fold_block_hash(hashes[len(cache)]))
        return cache

    return keys


class XavierWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``) so that ``init_xavier`` can
    reach the worker's connector with ``collective_rpc("xavier_attach")``."""

    def xavier_attach(self) -> bool:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return False
        connector = get_kv_transfer_group()
        if not isinstance(connector, XavierConnector):
            return False
        return bool(connector.attach(force=True, raise_errors=True))

    def xavier_set_batched_loads(self, batched: bool) -> bool:
        """Set the worker connector's load mode (see ``XavierEngine.set_batched_loads``)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return False
        connector = get_kv_transfer_group()
        if not isinstance(connector, XavierConnector):
            return False
        connector.batched_loads = bool(batched)
        return True
