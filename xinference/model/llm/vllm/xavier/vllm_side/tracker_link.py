"""The worker's :class:`~..planning.directory_link.DirectoryLink`: the ``VLLMBlockTracker``
actor, called through the bridge off the step thread."""

from __future__ import annotations

from typing import Any, List, Sequence

from ..planning.directory_link import Entry
from .actor_bridge import ActorBridge, LazyActor

#: longest a directory call of the storage writer may take
CALL_TIMEOUT_S = 30.0


class TrackerLink:
    """The storage writer's :class:`~.storage_writer.DirectoryLink`: blocking calls to the
    ``VLLMBlockTracker`` through the bridge (made off the step thread)."""

    def __init__(self, bridge: ActorBridge, tracker: LazyActor) -> None:
        self._bridge, self._tracker = bridge, tracker

    def _ref(self) -> Any:
        return self._tracker.get()  # unchecked: a ref without a lookup

    def register(self, rank: int, entries: Sequence[Entry]) -> int:
        ref, rows = self._ref(), [tuple(int(x) for x in e) for e in entries]
        try:
            return int(self._bridge.call(lambda: ref.register(rank, rows), CALL_TIMEOUT_S))
        except Exception:
            self._tracker.forget()
            raise

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        ref, ids = self._ref(), [int(s) for s in slots]
        try:
            return list(self._bridge.call(lambda: ref.claim(rank, tier, group, ids),
                                          CALL_TIMEOUT_S))
        except Exception:
            self._tracker.forget()
            raise

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int]) -> List[int]:
        ref, ids = self._ref(), [int(s) for s in slots]
        rows = [tuple(int(x) for x in e) for e in entries]
        try:
            return list(self._bridge.call(lambda: ref.move(rank, rows, tier, group, ids),
                                          CALL_TIMEOUT_S))
        except Exception:
            self._tracker.forget()
            raise
