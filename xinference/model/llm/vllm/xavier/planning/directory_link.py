"""How a rank's storage writer reaches the block directory (pure): the protocol, the entry
shapes, and an in-process link over a :class:`~.block_directory.BlockDirectory`."""

from __future__ import annotations

from typing import List, Optional, Protocol, Sequence, Tuple

from .block_directory import BlockDirectory

#: (group, key, tier, slot, generation), as the block directory records it
Entry = Tuple[int, int, int, int, int]
#: (group, key, engine block id) of a newly computed full block
ExportRow = Tuple[int, int, int]


class DirectoryLink(Protocol):
    """What the writer needs of the block directory.  Both are called off the step thread
    and may block (the worker's link calls the ``VLLMBlockTracker`` actor)."""

    def register(self, rank: int, entries: Sequence[Entry]) -> int: ...

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]: ...

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int]) -> List[int]:
        """``register(entries)`` then ``claim(tier, group, slots)`` in one call (a demotion:
        the lower copies become the blocks' locations, the upper slots are given up)."""
        ...


class LocalDirectory:
    """An in-process :class:`DirectoryLink` over a
    :class:`~.block_directory.BlockDirectory` (tests, benchmarks)."""

    def __init__(self, directory: Optional[BlockDirectory] = None) -> None:
        self.directory = directory or BlockDirectory()

    def register(self, rank: int, entries: Sequence[Entry]) -> int:
        return self.directory.register(rank, list(entries))

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return self.directory.claim(rank, tier, group, list(slots))

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int]) -> List[int]:
        return self.directory.move(rank, list(entries), tier, group, list(slots))
