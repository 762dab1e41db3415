"""Blocks registered in the block directory only once their bytes are there: the
publisher thread of a worker's :class:`~.storage_writer.StorageWriter`.

A :class:`Publication` is one call's entries and the event that marks their bytes:
exported copies into Xavier's tier (the storage's own incarnation), or blocks of vLLM's
own cache whose forward just completed (published in place: ``incarnation`` names the
engine's block generations).  :class:`Publisher` registers them in order, after their
event, one directory call each; a failure is counted (a later miss, never wrong KV).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from ..planning.counters import CounterSink
from ..planning.directory_link import DirectoryLink, Entry
from ..planning.log_names import package_logger
from ..planning.trace_spans import span
from .block_copy import slab_as

logger = package_logger(__name__)


@dataclass
class Publication:
    """What one export (or one step's in-place publication) registers once ``event``
    completed."""

    entries: List[Entry]
    keys: List[Tuple[int, int]]  # (group, key) pending until published
    event: Optional[torch.cuda.Event] = None
    #: CPU top tier of a CUDA engine: (tier views, slots, page-locked rows) to scatter
    scatter: List[Tuple[List[torch.Tensor], torch.Tensor, List[torch.Tensor]]] = field(
        default_factory=list)
    #: blocks of another storage than the writer's (vLLM's cache, published in place)
    incarnation: Optional[int] = None


class Publisher:
    """The thread that registers :class:`Publication` s in order (see the module
    docstring); ``done(pub)`` runs after each, registered or not."""

    def __init__(self, rank: int, directory: DirectoryLink, incarnation: int,
                 sink: CounterSink, done: Callable[[Publication], None]) -> None:
        self.rank, self._directory, self._incarnation = rank, directory, incarnation
        self._sink, self._done = sink, done
        self._queue: queue.Queue[Optional[Publication]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"xavier-publish-{rank}")
        self._thread.start()

    def put(self, pub: Publication) -> None:
        self._queue.put(pub)

    def _loop(self) -> None:
        while True:
            pub = self._queue.get()
            if pub is None:
                return
            in_place = pub.incarnation is not None
            try:
                if pub.event is not None:
                    pub.event.synchronize()
                for dst, slots, host in pub.scatter:
                    for d, h in zip(dst, host):
                        d.index_copy_(0, slots, slab_as(h, len(slots), d))
                incarnation = self._incarnation if pub.incarnation is None else pub.incarnation
                with span(self.rank, "publish", blocks=len(pub.entries)):  # (after the event)
                    self._directory.register(self.rank, pub.entries, incarnation)
                self._sink.add("in_place_registered" if in_place else "export_published",
                               len(pub.entries))
            except Exception as exc:  # unpublished blocks are only a later miss
                self._sink.add("in_place_register_failures" if in_place
                               else "export_publish_failures", len(pub.entries))
                logger.warning("rank %d: publishing %d blocks failed: %r", self.rank,
                               len(pub.entries), exc)
            finally:
                self._done(pub)

    def close(self, timeout: float) -> None:
        """Stop after what is queued (idempotent)."""
        self._queue.put(None)
        self._thread.join(timeout)
