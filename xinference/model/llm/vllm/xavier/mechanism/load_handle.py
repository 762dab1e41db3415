"""The load engine's boundary types: a launched load (:class:`LoadHandle`), its result
(:class:`LoadResult`), its errors, and what the engine keeps per mapped storage."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ..planning.load_batch import Tier
from ..planning.plan import LoadPlan, Transfer
from .kv_schema import KVLayout
from .read_checks import SourceIdentity


class TransferClosedError(RuntimeError):
    """The transfer engine is closed (or closing): no new loads or mappings."""


class LoadRejected(ValueError):
    """The batch was refused before any byte was written (the message says why)."""


class LoadError(RuntimeError):
    """A copy failed after it started; ``planned`` lists every destination of the
    batch (group -> block ids), some of which may be partly written."""

    def __init__(self, message: str, planned: Mapping[int, np.ndarray]) -> None:
        super().__init__(message)
        self.planned = planned


class CloseError(RuntimeError):
    """Some resources could not be released; ``close()`` may be called again."""


@dataclass(frozen=True)
class FetchedRows:
    """What a read from another host returned: per-layer ``uint8`` staging rows
    ``[transfer.rows, block_bytes]`` (CPU) and what the source said its slots held once it
    had gathered them (None: a source that keeps no identity)."""

    staging: List[torch.Tensor]
    identity: Optional[SourceIdentity] = None


#: Returns the blocks ``transfer.src_slots`` of a storage that is not mapped into this
#: process (another host); runs on the completion thread.  See :mod:`.remote_fetch`.
RemoteFetch = Callable[[Transfer], FetchedRows]


@dataclass(frozen=True)
class LoadResult:
    """What one finished ``load_gpu_requests_v1`` did (the typed result of a load)."""

    request_ids: Tuple[str, ...]
    transfers: int
    blocks_written: int
    useful_bytes: int
    padded_bytes: int
    #: destinations planned: group -> sorted block ids
    written: Mapping[int, np.ndarray] = field(repr=False)
    #: destination block ids (all groups) that were NOT written: vLLM must recompute them
    failed: frozenset = frozenset()


@dataclass
class MappedStorage:
    """A storage tier the load engine reads: mapped here, or read through ``fetch``."""

    rank: int
    tier: Tier
    layout: KVLayout
    layers: Dict[int, List[torch.Tensor]]  # block-first views
    release: Optional[Callable[[], None]]
    pointer_tables: Dict[int, torch.Tensor] = field(default_factory=dict)
    #: set for a remote storage (no local tensors): how to fetch its blocks
    fetch: Optional[RemoteFetch] = None
    #: page-locked host layers that ``layers`` view through CUDA (:mod:`.uva`): kept alive
    #: as long as the views are
    host_layers: Optional[Dict[int, List[torch.Tensor]]] = None
    #: the storage's slot generations as this process maps them
    #: (:class:`~.slot_generations.SlotGenerations`): what a read is checked against
    generations: Optional[Any] = None


@dataclass
class LoadJob:
    """What the completion thread finishes for one launched load."""

    handle: LoadHandle
    plan: LoadPlan
    event: Optional[torch.cuda.Event]
    background: List[Tuple[Transfer, MappedStorage]]
    launch_error: Optional[BaseException] = None
    #: every transfer of the plan with its storage (the reads the thread checks)
    reads: Sequence[Tuple[Transfer, MappedStorage]] = ()


class LoadHandle:
    """One launched ``load_gpu_requests_v1``.

    * :attr:`reportable`: every destination is written (or known failed: :attr:`failed`) as
      far as the caller's stream is concerned once it called :meth:`order`: copies still
      running on the engine's stream are ordered before anything the caller queues next;
      a load that read anything is reportable only once the completion thread finished it:
      its copies completed on the host and its reads checked (:mod:`.read_checks`) --
      what lets the scheduler half release the load's leases when vLLM reports it done
      (a load whose launch failed is reportable at once, every destination failed: the
      copies queued before the failure can only spoil blocks vLLM recomputes, after them);
    * :meth:`wait`: everything finished; the result, or the
      error of a load that failed after it started (:class:`LoadError`).
    """

    def __init__(self, request_ids: Tuple[str, ...], planned: Mapping[int, np.ndarray],
                 event: Optional[torch.cuda.Event], has_background: bool,
                 quick: bool = False) -> None:
        self.request_ids = request_ids
        self.planned = planned
        self.event = event
        #: none of its copies runs on the completion thread: unless they wait for work the
        #: caller queued, it is reportable within about a copy's time (a caller may wait)
        self.quick = quick
        self._has_background = has_background
        self._background_done = threading.Event()
        self._done = threading.Event()
        self._result: Optional[LoadResult] = None
        self._error: Optional[BaseException] = None
        self.failed: Set[int] = set()

    @property
    def reportable(self) -> bool:
        return not self._has_background or self._background_done.is_set()

    def wait_reportable(self, timeout: Optional[float] = None) -> bool:
        return not self._has_background or self._background_done.wait(timeout)

    def order(self, stream: Optional[torch.cuda.Stream]) -> None:
        """Make ``stream`` wait for the launched copies (no host wait)."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> LoadResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"load of {len(self.request_ids)} requests not done after "
                               f"{timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def wait_until_reportable(handles: Iterable[Any], deadline: float) -> int:
    """Wait, until ``deadline`` (``time.perf_counter``) at most, until each of ``handles``
    (:class:`LoadHandle`) can be reported; returns the microseconds waited."""
    start = time.perf_counter()
    for h in handles:
        h.wait_reportable(max(0.0, deadline - time.perf_counter()))
    return int(1e6 * (time.perf_counter() - start))


#: how often :func:`wait_for_any` looks at the handles it does not wait on
ANY_POLL_S = 0.0005


def wait_for_any(handles: Sequence[Any], deadline: float) -> int:
    """Wait, until ``deadline`` at most, until one of ``handles`` can be reported (each is
    looked at every :data:`ANY_POLL_S`); returns the microseconds waited."""
    start = now = time.perf_counter()
    while not any(h.reportable for h in handles) and now < deadline:
        handles[0].wait_reportable(min(ANY_POLL_S, deadline - now))
        now = time.perf_counter()
    return int(1e6 * (now - start))
