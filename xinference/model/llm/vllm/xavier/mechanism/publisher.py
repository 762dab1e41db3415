"""Blocks registered in the block directory only once their bytes are there: the
publisher thread of a worker's :class:`~.storage_writer.StorageWriter`.

A :class:`Publication` is one call's entries and the event that marks their bytes:
exported copies into Xavier's tier (the storage's own incarnation), or blocks of vLLM's
own cache whose forward just completed (published in place: ``incarnation`` names the
engine's block generations).  :class:`Publisher` registers them in order, after their
event; those that queued while the directory answered the last call go in one call
(``directory_calls_coalesced``: a busy directory gets fewer, larger calls, and the engine's
process makes fewer); a failure is counted (a later miss, never wrong KV).  The directory
calls wait until the worker launched no load or save for a while (:mod:`.quiet_gate`: not
inside the steps a cross-replica hit waits through); host-index writes do not wait for them.

While the whole launch is on this host the scheduler marks in-place publications
``local``: they go into the worker's host index only, where every peer looks
(:mod:`.host_holders`), and no directory call is made for them.  The publisher switches in
order: before the first local one it drops its worker's in-place entries (its shard's
directory groups) from the directory (``forget_in_place``: none is left behind to go stale
there), before the first one after them that is not local it registers again every block
the index says the engine still holds (``republish``), so that a replica of another host
finds them.  A change of the scheduler's word in a step with no new block comes as a
publication with no entries: the switch alone.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from ..planning.counters import CounterSink
from ..planning.directory_link import DirectoryLink, Entry, LocalPublishing
from ..planning.log_names import package_logger
from ..planning.trace_spans import span
from .block_copy import slab_as
from .quiet_gate import QuietGate

logger = package_logger(__name__)

#: at most this many queued publications are taken together (one directory call)
MAX_COALESCED = 64


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
    #: in place, the whole launch on this host: into the host index only (module docstring)
    local: bool = False


def _complete(pub: Publication) -> bool:
    """Whether ``pub``'s event has completed (an error: treated as complete, so that its
    ``synchronize`` reports it where the publication is failed and counted)."""
    try:
        return pub.event is None or bool(pub.event.query())
    except Exception:
        return True


class Publisher:
    """The thread that registers :class:`Publication` s in order (see the module
    docstring); ``done(pub)`` runs after each, registered or not.  A directory call first
    waits for ``quiet`` (:mod:`.quiet_gate`: not inside a hit's wait); the host index's
    writes do not."""

    def __init__(self, rank: int, directory: DirectoryLink, incarnation: int,
                 sink: CounterSink, done: Callable[[Publication], None],
                 quiet: Optional[QuietGate] = None) -> None:
        self.rank, self._directory, self._incarnation = rank, directory, incarnation
        self._sink, self._done, self._quiet = sink, done, quiet
        #: runs of publications for the directory, waiting for the worker to be quiet
        self._runs: List[List[Publication]] = []
        self._deferred_since = 0.0
        self._local = False  # in-place publications go into the host index only
        self._queue: queue.Queue[Optional[Publication]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"xavier-publish-{rank}")
        self._thread.start()

    def put(self, pub: Publication) -> None:
        self._queue.put(pub)
        if self._quiet is not None:
            self._quiet.poke()  # (a deferred run waits: this one may go first)

    def _loop(self) -> None:
        carried: Optional[Publication] = None  # taken, its event not complete: next batch
        while True:
            batch = [carried if carried is not None else self._queue.get()]
            carried = None
            while batch[-1] is not None and len(batch) < MAX_COALESCED:
                try:
                    pub = self._queue.get_nowait()
                except queue.Empty:
                    break
                if pub is not None and not _complete(pub):
                    carried = pub  # (waiting for it would hold back those before it)
                    break
                batch.append(pub)
            self._publish([pub for pub in batch if pub is not None])
            if batch[-1] is None:
                self._register_deferred()
                return
            if self._runs and self._may_register(carried):
                self._register_deferred()  # (else: what queued meanwhile first)

    def _publish(self, batch: List[Publication]) -> None:
        """Take ``batch`` in order, each after its event (and its CPU tier's scatter): into
        the host index at once, or into the runs deferred for the directory (consecutive
        ones of one incarnation: one call each).  The runs go when the worker is quiet
        (:meth:`_loop`); what queued meanwhile joins them (a busy directory or worker gets
        fewer, larger calls; an idle one is called as each publication comes).  A write
        into the host index may overtake a deferred run (another storage's rows)."""
        for pub in batch:
            in_place = pub.incarnation is not None
            incarnation = self._incarnation if pub.incarnation is None else pub.incarnation
            try:
                if pub.event is not None:
                    pub.event.synchronize()
                for dst, slots, host in pub.scatter:
                    for d, h in zip(dst, host):
                        d.index_copy_(0, slots, slab_as(h, len(slots), d))
            except Exception as exc:
                self._failed([pub], exc)
                continue
            if in_place and pub.local != self._local:
                self._register_deferred()  # (what came before the switch, first)
                self._local = self._switched(pub.local)
            if in_place and self._local:
                try:
                    with span(self.rank, "publish", blocks=len(pub.entries), local=1):
                        kept = self._local_link().register_local(self.rank, pub.entries,
                                                                 incarnation)
                except Exception as exc:
                    self._failed([pub], exc)
                    continue
                self._sink.add("in_place_kept_local", kept)
                self._sink.add("in_place_registered", len(pub.entries))
                self._done(pub)
                continue
            if not self._runs:
                self._deferred_since = self._quiet.clock() if self._quiet else 0.0
            if not self._runs or self._incarnation_of(self._runs[-1][0]) != incarnation:
                self._runs.append([])
            self._runs[-1].append(pub)

    def _may_register(self, carried: Optional[Publication]) -> bool:
        """Whether the deferred runs go now: once the worker is quiet; False when other
        work came first (a publication queued, or ``carried``'s forward completed)."""
        if self._quiet is None:
            return True
        if carried is not None:
            pub = carried
            return self._quiet.wait(since=self._deferred_since, interrupt=lambda: _complete(pub))
        return self._quiet.wait(since=self._deferred_since,
                                interrupt=lambda: not self._queue.empty())

    def _register_deferred(self) -> None:
        runs, self._runs = self._runs, []
        for run in runs:
            self._register(run)

    def _incarnation_of(self, pub: Publication) -> int:
        return self._incarnation if pub.incarnation is None else pub.incarnation

    def _register(self, run: List[Publication]) -> None:
        """One directory call for ``run`` (publications of one incarnation, in order)."""
        if not run:
            return
        entries = [e for pub in run for e in pub.entries]
        try:
            if entries:  # (none: a switch only)
                with span(self.rank, "publish", blocks=len(entries), local=0,
                          publications=len(run)):
                    self._directory.register(self.rank, entries, self._incarnation_of(run[0]))
                self._sink.add("directory_calls_coalesced", len(run) - 1)
        except Exception as exc:  # unpublished blocks are only a later miss
            self._failed(run, exc)
            return
        for pub in run:
            self._sink.add("in_place_registered" if pub.incarnation is not None
                           else "export_published", len(pub.entries))
            self._done(pub)

    def _failed(self, pubs: List[Publication], exc: Exception) -> None:
        for pub in pubs:
            self._sink.add("in_place_register_failures" if pub.incarnation is not None
                           else "export_publish_failures", len(pub.entries))
            self._done(pub)
        logger.warning("rank %d: publishing %d blocks failed: %r", self.rank,
                       sum(len(pub.entries) for pub in pubs), exc)

    def _local_link(self) -> LocalPublishing:
        if not isinstance(self._directory, LocalPublishing):
            raise TypeError(f"{type(self._directory).__name__}: no host index to publish into")
        return self._directory

    def _switched(self, local: bool) -> bool:
        """Switch in-place publications to the host index only (``local``) or back to the
        directory (module docstring); returns whether they are local now: a failed switch
        to local leaves them registered (tried again at the next one), a failed switch back
        still registers what follows (the blocks before it: a miss on another host)."""
        try:
            link = self._local_link()
            t0 = time.monotonic()
            if local:
                n = link.forget_in_place(self.rank)
            else:
                n = link.republish(self.rank)
                self._sink.add("in_place_republished", n)
            logger.info("rank %d: the whole launch %s this host: %d in-place blocks %s the "
                        "directory in %.2f s", self.rank, "is on" if local else "is no longer on",
                        n, "dropped from" if local else "registered again in",
                        time.monotonic() - t0)
            return local
        except Exception as exc:
            logger.warning("rank %d: %s failed: %r", self.rank, "dropping its in-place blocks "
                           "from the directory" if local else "registering its in-place blocks "
                           "again", exc)
            self._sink.add("in_place_register_failures", 1)
            return False

    def close(self, timeout: float) -> None:
        """Stop after what is queued (idempotent)."""
        self._queue.put(None)
        self._thread.join(timeout)
