"""The completion thread of one load engine (steps 4 and 5 of :mod:`.gpu_transfer`).

:class:`LoadCompletion` takes each launched load (:class:`~.load_handle.LoadJob`), waits
for its event, runs the transfers that read host memory into a CUDA engine or arrive from
another host, checks every read against the identity its source holds now
(:mod:`.read_checks`: a read that does not hold is a failed block), counts the result and
completes the :class:`~.load_handle.LoadHandle`.  Leases are not its business: the
scheduler half releases them once vLLM reports the load done on every worker, which a
worker does only after this thread finished the load.  It touches only what a job
captured and the engine parts handed to :meth:`LoadCompletion.start`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ..planning.counters import CounterSink
from ..planning.log_names import package_logger
from ..planning.plan import Transfer
from ..planning.trace_spans import span
from .block_copy import copy_transfer, slab_as
from .kv_schema import KVLayout
from .load_handle import (
    FetchedRows,
    LoadError,
    LoadHandle,
    LoadJob,
    LoadResult,
    MappedStorage,
)
from .read_checks import SourceIdentity, check_read
from .slabs import SlabPool

logger = package_logger(__name__)

@dataclass
class EngineParts:
    """What the completion thread writes into: the engine's block-first layers per group,
    their layout, device and copy stream, and the thread's own slabs."""

    layers: Dict[int, List[torch.Tensor]]
    layout: KVLayout
    device: torch.device
    stream: Optional[torch.cuda.Stream]
    slabs: SlabPool


def on_stream(stream: Optional[torch.cuda.Stream]) -> contextlib.AbstractContextManager[Any]:
    """``stream`` as the current CUDA stream (nothing on CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def record_event(stream: Optional[torch.cuda.Stream]) -> Optional[torch.cuda.Event]:
    """An event recorded on ``stream`` (``None`` on CPU)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _any_in(blocks: np.ndarray, failed: Set[int]) -> bool:
    """Whether one of ``blocks`` is in ``failed`` (nothing to look up when none failed)."""
    return bool(failed) and bool(np.isin(blocks, list(failed)).any())


class LoadCompletion:
    """The completion thread of one load engine."""

    def __init__(self, rank: int, sink: CounterSink, finished: Callable[[LoadHandle], None],
                 validate_reads: bool = True) -> None:
        """``validate_reads``: check every read after its copy (:mod:`.read_checks`); off
        only in tests, as the negative control that shows what the check catches."""
        self.rank = rank
        self.sink = sink
        self.validate_reads = validate_reads
        self._finished = finished
        #: mapped storages found to be of a storage that is gone (their owner removed the
        #: generations file) while a load's rows named another: :meth:`take_stale`
        self._stale: List[MappedStorage] = []
        self._stale_lock = threading.Lock()
        self._parts: Optional[EngineParts] = None
        self._jobs: queue.Queue[Optional[LoadJob]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def start(self, parts: EngineParts) -> None:
        """(Re)bind the engine's parts; starts the thread once."""
        self._parts = parts
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"xavier-load-completion-{self.rank}")
            self._thread.start()

    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def take_stale(self) -> List[MappedStorage]:
        """The mapped storages found stale since the last call (see :meth:`_check_reads`)."""
        with self._stale_lock:
            stale, self._stale = self._stale, []
        return stale

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after the jobs already submitted."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=timeout)
            self._thread = None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with span(self.rank, "complete"):
                    self._complete(job)
            except BaseException as exc:  # never let the thread die: the handle fails
                logger.exception("rank %d: completing a load failed", self.rank)
                job.handle.failed = {int(b) for ids in job.plan.written.values() for b in ids}
                job.handle._error = exc
                job.handle._background_done.set()
                job.handle._done.set()

    def _complete(self, job: LoadJob) -> None:
        handle, plan = job.handle, job.plan
        failed: Set[int] = set()
        error = job.launch_error
        try:
            if job.event is not None:
                job.event.synchronize()
        except BaseException as exc:  # a device fault: nothing of this load is trusted
            error = error or exc
        fetched: Dict[int, SourceIdentity] = {}  # id(transfer) -> what the source sent
        if error is None:
            for t, st in job.background:
                try:
                    identity = self._run_background(t, st)
                    if identity is not None:
                        fetched[id(t)] = identity
                except BaseException as exc:  # this transfer's blocks are recomputed
                    logger.warning("rank %d: load of %d blocks from rank %d %s failed: %r",
                                   self.rank, len(t.dst_blocks), t.source_rank, t.tier.name,
                                   exc)
                    failed.update(int(b) for b in t.dst_blocks)
            if self.validate_reads:
                failed.update(self._check_reads(job.reads, fetched, failed))
        handle.failed = failed if error is None else {
            int(b) for ids in plan.written.values() for b in ids}
        handle._background_done.set()
        sink = self.sink
        if error is not None:
            sink.add("load_failures")
            logger.error("rank %d: load of %d requests failed during copy: %r", self.rank,
                         len(plan.request_ids), error)
            handle._error = LoadError(f"copy failed: {error!r}", plan.written)
        else:
            layout = self._parts.layout if self._parts is not None else None
            block_bytes = {g.group: g.block_bytes for g in layout.groups} if layout else {}
            ok = [t for t in plan.transfers if not _any_in(t.dst_blocks, failed)]
            useful = sum(t.rows * block_bytes.get(t.group, 0) for t in ok)
            padded = sum(t.padded_rows * block_bytes.get(t.group, 0) for t in plan.transfers)
            written = plan.blocks_written - len(failed)
            if failed:
                sink.add("load_failures")
            sink.add("batch_calls")
            sink.add("logical_requests", len(plan.request_ids))
            sink.add("transfers", len(plan.transfers))
            sink.add("useful_bytes", useful)
            sink.add("padded_bytes", padded)
            sink.add("blocks_written", written)
            handle._result = LoadResult(plan.request_ids, len(plan.transfers), written, useful,
                                        padded, plan.written, frozenset(failed))
        self._finished(handle)
        handle._done.set()

    def _check_reads(self, reads: Sequence[Tuple[Transfer, MappedStorage]],
                     fetched: Dict[int, SourceIdentity], failed: Set[int]) -> Set[int]:
        """The destinations of ``reads`` whose read did not hold (copies complete): each
        transfer's promised identity against the source's now -- read from its mapped
        generations here, or as the source sent it with the bytes (``fetched``)."""
        bad: Set[int] = set()
        for t, st in reads:
            if _any_in(t.dst_blocks, failed):
                continue  # already failed: recomputed whatever it holds
            try:
                if st.fetch is not None:
                    now = fetched.get(id(t))
                elif st.generations is not None:
                    now = SourceIdentity(st.generations.incarnation, st.generations.row(
                        int(t.tier), t.group)[t.src_slots].copy())
                else:
                    now = None
                result = check_read(t, now)
            except Exception as exc:  # the identity cannot be read: nothing is trusted
                logger.warning("rank %d: checking a read of rank %d failed: %r", self.rank,
                               t.source_rank, exc)
                self.sink.add("validation_failures", t.rows)
                bad.update(t.dst_blocks.tolist())
                continue
            if result is None:
                self.sink.add("reads_unchecked", t.rows)
                continue
            self.sink.add("reads_validated", t.rows)
            if result.ok:
                continue
            self.sink.add("validation_failures", result.failed_rows)
            bad.update(result.failed_blocks.tolist())
            # rows of another incarnation: stale rows (an answer older than a restart), or
            # a stale mapping -- only then is the mapped storage's file gone (its owner
            # closed it), and mapping the peer again helps
            gone = (result.stale_mapping and st.generations is not None
                    and not os.path.exists(st.generations.path))
            if gone:
                with self._stale_lock:
                    self._stale.append(st)
            logger.warning("rank %d: %d of %d blocks read from rank %d %s no longer held what "
                           "they were named for%s: recomputed", self.rank, result.failed_rows,
                           t.rows, t.source_rank, t.tier.name,
                           " (the mapped storage is gone)" if gone else "")
        return bad

    def _run_background(self, t: Transfer, st: MappedStorage) -> Optional[SourceIdentity]:
        """A transfer from host memory (a CPU tier) into a CUDA engine, or from another
        host; returns when its writes are complete, with what the source said it held
        (another host's answer; None for a mapped storage)."""
        parts = self._parts
        assert parts is not None
        dst = parts.layers[t.group]
        if st.fetch is not None:
            rows: FetchedRows = st.fetch(t)
            self._write_staged(t, rows.staging)
            return rows.identity
        with on_stream(parts.stream):
            dev = parts.device
            copy_transfer(st.layers[t.group], dst, parts.slabs.get(t.group, t.slab_rows),
                          torch.from_numpy(t.src_slots), torch.from_numpy(t.dst_blocks).to(dev),
                          torch.from_numpy(t.dst_rows).to(dev), t.identity_rows)
            event = record_event(parts.stream)
        if event is not None:
            event.synchronize()
        self.sink.add("loads_in_background")
        return None

    def _write_staged(self, t: Transfer, staging: Sequence[torch.Tensor]) -> None:
        """Write staged rows into the destination blocks on the engine's copy stream, and
        wait for them -- also when a copy fails half way: the ones already queued must not
        land after vLLM was told the blocks failed and started recomputing them."""
        parts = self._parts
        assert parts is not None
        try:
            with on_stream(parts.stream):
                dst_blocks = torch.from_numpy(t.dst_blocks).to(parts.device)
                for s, d in zip(staging, parts.layers[t.group]):
                    values = slab_as(s, t.rows, d)
                    if not t.identity_rows:
                        values = values.index_select(0, torch.from_numpy(t.dst_rows))
                    d.index_copy_(0, dst_blocks, values.to(parts.device, non_blocking=True))
        finally:
            event = record_event(parts.stream)
            if event is not None:
                event.synchronize()
        self.sink.add("loads_in_background")
