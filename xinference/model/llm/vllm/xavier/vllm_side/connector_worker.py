"""The worker half of :class:`~.connector.XavierConnector` (vLLM worker process).

Hands vLLM's KV caches to the worker's :class:`~.worker_plane.WorkerDataPlane` and each
step's :class:`~..planning.step_meta.StepMeta` to it: loads launched before the
forward, exports after it, finished loads and failed blocks reported back to vLLM.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ..mechanism.in_place import share_host_caches
from ..planning.counters import elapsed_us
from ..planning.load_batch import DEST
from ..planning.log_names import package_logger
from ..planning.options import XavierOptions
from ..planning.step_hold import StepHoldClock, count_step_hold
from ..planning.step_meta import StepMeta
from .actor_bridge import ActorBridge
from .connector_stats import CounterDeltas, XavierKVConnectorStats
from .kv_caches import group_layers
from .worker_plane import WorkerDataPlane

logger = package_logger(__name__)


def vllm_defers_block_frees(vllm_config: Any) -> bool:
    """Whether this engine's scheduler keeps a freed block out of the pool while a step in
    flight may write it: vLLM >= 0.26 (``Scheduler._drain_deferred_frees``) does for a KV
    consumer with several batches in flight (``scheduler.py``: ``defer_block_free``, the
    same condition).  What lets a load and a victim save skip the forward in flight."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:  # (ordered after the forward then: always correct)
        return False
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return (hasattr(Scheduler, "_drain_deferred_frees") and transfer is not None
            and bool(getattr(transfer, "is_kv_consumer", False))
            and int(getattr(vllm_config, "max_concurrent_batches", 1)) > 1)


class XavierConnectorWorker:
    """Worker-side state of one vLLM worker: its data plane (once the caches are known) and
    the failed blocks not yet reported to vLLM."""

    def __init__(self, options: XavierOptions, bridge: ActorBridge,
                 group_layer_names: List[List[str]], num_blocks: int,
                 tp_size: int = 1, defers_block_frees: bool = False,
                 overlapped: bool = True) -> None:
        """``defers_block_frees``: vLLM's scheduler of this engine keeps freed blocks out of
        the pool while a step in flight may write them (:func:`vllm_defers_block_frees`);
        ``overlapped``: several batches may be in flight (async scheduling)."""
        self.options = options
        self._bridge = bridge
        self._group_layer_names = group_layer_names
        self._num_blocks = num_blocks
        self.plane: Optional[WorkerDataPlane] = None
        self._load_errors: Set[int] = set()
        #: requests whose loads failed without reaching a data plane: reported finished next
        self._failed_requests: Set[str] = set()
        self._tp_size = tp_size
        self._defers_block_frees, self._overlapped = defers_block_frees, overlapped
        self._tp_rank = 0
        self._device: Optional[torch.device] = None
        self._stats: Optional[CounterDeltas] = None
        #: this step's time in the connector so far (closed by :meth:`finished_loads`)
        self._hold = StepHoldClock()
        self._in_place_local = False  # what the last in-place publication said

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> Optional[str]:
        """Build the data plane on ``kv_caches`` and attach it; returns why sharing cannot
        run on these caches (``None`` when it can)."""
        try:
            self._tp_rank = _tp_rank() if self._tp_size > 1 else 0
            groups, dims = group_layers(kv_caches, self._group_layer_names, self._num_blocks)
            self._device = groups[min(groups)][0][1].device
            shared = None
            if self.options.in_place and self._device.type == "cpu":
                # vLLM's CPU cache is this process's private memory: into /dev/shm, in
                # place, before the first real forward, so that peers can read it
                shared = share_host_caches({g: [t for _, t in ls] for g, ls in groups.items()},
                                           others=list(kv_caches.values()))
            try:
                self.plane = WorkerDataPlane(self.options, self._bridge, groups, dims,
                                             tp_rank=self._tp_rank, tp_size=self._tp_size,
                                             num_blocks=self._num_blocks, shared_host=shared,
                                             defers_block_frees=self._defers_block_frees,
                                             overlapped=self._overlapped)
            except BaseException:
                if shared is not None:  # vLLM keeps serving on the moved memory; the
                    shared.close()  # files go (a mapping keeps its memory)
                raise
        except Exception as exc:
            return f"KV caches cannot be shared: {exc}"
        logger.info("xavier: rank %d TP worker %d/%d: KV caches registered (%d groups, %s)",
                    self.options.rank, self._tp_rank, self._tp_size, len(groups),
                    self._device)
        self.plane.attach()
        self._stats = CounterDeltas(self.plane.counters.get)
        return None

    def stats(self) -> Optional[XavierKVConnectorStats]:
        """What changed since the last call, for vLLM's connector statistics (None when
        nothing did, or before the caches are registered)."""
        return self._stats.take() if self._stats is not None else None

    def fail_loads(self, step: Optional[StepMeta]) -> None:
        """Report every load of ``step`` failed (no data plane: vLLM recomputes them)."""
        if step is not None and step.has_loads:
            self._load_errors.update(int(b) for b in step.loads.table[:, DEST])
            self._load_errors.update(step.failed_dests)
            self._failed_requests.update(step.loads.request_ids)  # vLLM must not wait on them

    def start_loads(self, step: Optional[StepMeta]) -> None:
        """Launch ``step``'s loads on the data plane (never waits for them)."""
        with elapsed_us(self._hold.add):
            self._start_loads(step)

    def _start_loads(self, step: Optional[StepMeta]) -> None:
        plane = self.plane
        if step is None:
            return
        self._hold.add(step.stats.scheduler_us)  # the step's scheduler half
        if plane is None:
            self.fail_loads(step)
            return
        if not plane.attached:
            plane.attach()
        if self._tp_rank == 0:  # the scheduler's figures, counted once per replica
            plane.add_step_stats(step.stats.as_dict())
        # the victims, before the loads and the forward write any of them
        saved = plane.save(step.saves) if step.saves else None
        plane.load(step, saved)

    def export(self, step: Optional[StepMeta]) -> None:
        """After the forward: publish ``step``'s newly full blocks in place, or export them
        (never waits on the host)."""
        if step is None or self.plane is None:
            return
        with elapsed_us(self._hold.add):
            if step.exports:
                self.plane.export(step.exports)
            if step.in_place or step.in_place_local != self._in_place_local:
                # (a change with no rows still reaches the publisher: it switches in order,
                # and the scheduler's forgets skipped while local are covered by it)
                self._in_place_local = step.in_place_local
                self.plane.publish_in_place(step.in_place, step.in_place_local)

    def finished_loads(self, idle: bool = False
                       ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """``(None, requests whose loads are done)``, vLLM's stream ordered after them; their
        failed blocks are kept for :meth:`take_load_errors`.  ``idle``: no forward in this
        step nor the one before (the plane may wait a little for a load in flight; counted
        in the step's hold, since a request that arrives meanwhile waits for it too).  The
        step's last call: its hold is counted here (:mod:`..planning.step_hold`)."""
        with elapsed_us(self._hold.add):
            done, self._failed_requests = self._failed_requests, set()
            if self.plane is not None:
                stream = torch.cuda.current_stream(self._device) if (
                    self._device is not None and self._device.type == "cuda") else None
                loaded, failed = self.plane.finished(stream, idle)
                self._load_errors.update(failed)
                done |= loaded
        held = self._hold.take()
        if self.plane is not None and self._tp_rank == 0:  # (once per replica, as the
            count_step_hold(self.plane.counters, held)  # scheduler's figures)
        return None, (done or None)

    def take_load_errors(self) -> Set[int]:
        """Failed blocks not reported yet (drained)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close the data plane (loads and exports in flight finish, mappings go)."""
        if self.plane is not None:
            self.plane.close()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's TP group exists once the worker built
    its model, before it registers the KV caches)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
