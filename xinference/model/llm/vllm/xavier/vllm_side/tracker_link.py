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
        return int(self._call("register", rank, [tuple(int(x) for x in e) for e in entries],
                              int(incarnation)))

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return list(self._call("claim", rank, tier, group, [int(s) for s in slots]))

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        return list(self._call("move", rank, [tuple(int(x) for x in e) for e in entries],
                               tier, group, [int(s) for s in slots], int(incarnation)))
