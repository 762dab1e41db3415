"""How a rank's storage writer reaches the block directory (pure): the protocol, the entry
shapes, and an in-process link over a :class:`~.block_directory.BlockDirectory`."""

from __future__ import annotations

from typing import List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from .block_directory import BlockDirectory
from .load_batch import Tier
from .shards import Shards

#: (group, key, tier, slot, generation), as the block directory records it
Entry = Tuple[int, int, int, int, int]
#: (group, key, engine block id) of a newly computed full block
ExportRow = Tuple[int, int, int]


class DirectoryLink(Protocol):
    """What the writer needs of the block directory.  Both are called off the step thread
    and may block (the worker's link calls the ``VLLMBlockTracker`` actor)."""

    def register(self, rank: int, entries: Sequence[Entry], incarnation: int = 0) -> int:
        """Record ``entries`` written by the storage ``incarnation`` of ``rank``
        (:mod:`~..mechanism.slot_generations`; 0: a storage that names none)."""
        ...

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]: ...

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        """``register(entries)`` then ``claim(tier, group, slots)`` in one call (a demotion:
        the lower copies become the blocks' locations, the upper slots are given up)."""
        ...


@runtime_checkable
class LocalPublishing(Protocol):
    """A link that can also keep blocks of vLLM's own cache out of the directory while the
    whole launch is on one host (its host index is then where peers find them:
    :mod:`~..mechanism.host_holders`), and bring the directory back up to date."""

    def register_local(self, rank: int, entries: Sequence[Entry], incarnation: int = 0
                       ) -> int:
        """Record ``entries`` (of vLLM's cache) where same-host peers look, not in the
        directory; returns how many were written."""
        ...

    def forget_in_place(self, rank: int, groups: Optional[Sequence[int]] = None) -> int:
        """Drop the entries of ``rank``'s vLLM cache (of directory ``groups`` only, if
        given) from the directory (from now on they are recorded locally only)."""
        ...

    def republish(self, rank: int) -> int:
        """Register in the directory every block of ``rank``'s vLLM cache recorded locally
        and still held (the launch no longer lives on one host)."""
        ...


class LocalDirectory:
    """An in-process :class:`DirectoryLink` over a
    :class:`~.block_directory.BlockDirectory` (tests, benchmarks)."""

    def __init__(self, directory: Optional[BlockDirectory] = None) -> None:
        self.directory = directory or BlockDirectory()

    def register(self, rank: int, entries: Sequence[Entry], incarnation: int = 0) -> int:
        return self.directory.register(rank, list(entries), incarnation)

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return self.directory.claim(rank, tier, group, list(slots))

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        return self.directory.move(rank, list(entries), tier, group, list(slots), incarnation)

    def forget_in_place(self, rank: int, groups: Optional[Sequence[int]] = None) -> int:
        """Drop ``rank``'s entries of vLLM's cache (``Tier.VLLM``, as the tracker does)."""
        return self.directory.forget(rank, int(Tier.VLLM), None, groups)


class ShardLink:
    """The link of TP worker ``tp_rank``: its writer names KV-cache groups, the directory
    holds directory groups (:mod:`.shards`); every call is passed on translated."""

    def __init__(self, link: DirectoryLink, shards: Shards, tp_rank: int) -> None:
        shards.directory_group(0, tp_rank)  # checks tp_rank
        self._link, self._shards, self._tp_rank = link, shards, tp_rank

    def _group(self, group: int) -> int:
        return self._shards.directory_group(int(group), self._tp_rank)

    def _entries(self, entries: Sequence[Entry]) -> List[Entry]:
        return [(self._group(g), key, tier, slot, gen) for g, key, tier, slot, gen in entries]

    def register(self, rank: int, entries: Sequence[Entry], incarnation: int = 0) -> int:
        return self._link.register(rank, self._entries(entries), incarnation)

    def claim(self, rank: int, tier: int, group: int, slots: Sequence[int]) -> List[int]:
        return self._link.claim(rank, tier, self._group(group), slots)

    def move(self, rank: int, entries: Sequence[Entry], tier: int, group: int,
             slots: Sequence[int], incarnation: int = 0) -> List[int]:
        return self._link.move(rank, self._entries(entries), tier, self._group(group), slots,
                               incarnation)

    # (:class:`LocalPublishing`, when the link it wraps is one: a host index's link)
    def register_local(self, rank: int, entries: Sequence[Entry], incarnation: int = 0
                       ) -> int:
        return self._local().register_local(rank, self._entries(entries), incarnation)

    def forget_in_place(self, rank: int, groups: Optional[Sequence[int]] = None) -> int:
        # this worker's shard only: another worker's publisher switches on its own
        mine = [self._group(g) for g in range(self._shards.num_groups)]
        return self._local().forget_in_place(rank, mine if groups is None else groups)

    def republish(self, rank: int) -> int:
        return self._local().republish(rank)  # (its index holds directory groups)

    def _local(self) -> LocalPublishing:
        if not isinstance(self._link, LocalPublishing):
            raise TypeError(f"{type(self._link).__name__} keeps no local record of blocks")
        return self._link
