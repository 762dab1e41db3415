"""The worker's :class:`~..planning.directory_link.DirectoryLink`: the ``VLLMBlockTracker``
actor, called through the bridge off the step thread; rows and slots go
:class:`~..planning.directory_types.Packed` (what xoscar serializes item by item costs the
engine's process CPU beside its steps)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..mechanism.host_index import HostIndex, HostIndexLink
from ..planning.directory_link import DirectoryLink, Entry, ShardLink
from ..planning.directory_types import Packed
from ..planning.routes import host_id
from ..planning.shards import Shards
from .actor_bridge import ActorBridge, LazyActor

#: longest a directory call of the storage writer may take
CALL_TIMEOUT_S = 30.0


class TrackerLink:
    """The storage writer's :class:`~..planning.directory_link.DirectoryLink`: blocking calls to the
    ``VLLMBlockTracker`` through the bridge (made off the step thread)."""

    def __init__(self, bridge: ActorBridge, tracker: LazyActor) -> None:
        self._bridge, self._tracker = bridge, tracker

    def _call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the tracker; a failure forgets the ref (looked up again next
        time: the directory may have restarted) and raises."""
        ref = self._tracker.get()  # unchecked: a ref without a lookup
        try:
            return self._bridge.call(lambda: getattr(ref, method)(*args), CALL_TIMEOUT_S)
        except Exception:
            self._tracker.forget()
            raise

    def register(self, rank: int, entries: Sequence[Entry], incarnation: int = 0) -> int:
        return int(self._call("register", rank, Packed([tuple(map(int, e)) for e in entries]),
                              int(incarnation)))

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return list(self._call("claim", rank, tier, group, Packed([int(s) for s in slots])))

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        return list(self._call("move", rank, Packed([tuple(map(int, e)) for e in entries]),
                               tier, group, Packed([int(s) for s in slots]), int(incarnation)))

    def forget_in_place(self, rank: int, groups: Optional[Sequence[int]] = None) -> int:
        return int(self._call("forget_in_place", rank,
                              None if groups is None else [int(g) for g in groups]))

    def announce_index(self, rank: int, tp_rank: int, path: str) -> None:
        """Worker ``tp_rank`` of ``rank`` writes its host index at ``path`` on this host."""
        self._call("announce_index", rank, tp_rank, host_id(), path)

    def announce_index_soon(self, rank: int, tp_rank: int, path: str) -> None:
        """:meth:`announce_index` without waiting (a failure is logged; the first
        publication announces it again).  Made as the engine registered: until its index
        is announced, its rank counts as one of another host for every same-host peer,
        which then registers its whole vLLM cache in the directory again
        (:mod:`~..mechanism.publisher`) -- a replica that started, or came back, and
        served nothing yet would keep them so."""
        ref, host = self._tracker.get(), host_id()
        self._bridge.submit(lambda: ref.announce_index(rank, tp_rank, host, path),
                            f"announcing the host index of rank {rank}")


def writer_link(bridge: ActorBridge, tracker: LazyActor, rank: int, shards: Shards,
                tp_rank: int, index: Optional[HostIndex]) -> DirectoryLink:
    """The storage writer's link: the tracker, with the worker's host index written first
    (``index``, announced now without waiting), translated to its shard's directory
    groups (tensor parallel)."""
    direct = TrackerLink(bridge, tracker)
    link: DirectoryLink = direct
    if index is not None:
        path = index.path
        link = HostIndexLink(direct, index, lambda: direct.announce_index(rank, tp_rank, path))
        direct.announce_index_soon(rank, tp_rank, path)
    if shards.tp_size > 1:
        link = ShardLink(link, shards, tp_rank)
    return link
