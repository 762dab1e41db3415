"""Tensor-parallel shards as the block directory sees them (pure).

A replica of ``tp_size`` vLLM workers holds each KV block in ``tp_size`` places: worker
``k`` holds shard ``k`` (its KV heads) of every KV-cache group.  Each worker stores its own
shards in its own storage and registers them itself; the block directory names the shard
``k`` of KV-cache group ``g`` as its own *directory group*::

    directory_group = g * tp_size + k

So nothing in the directory is TP-specific: a lookup asks for every directory group of the
replica (:meth:`Shards.directory_groups`) and :meth:`~.block_directory.BlockDirectory.
query_prefix` answers only the prefix held in ALL of them, so a block is loadable only when
every shard of it is stored (a shard not yet published, or already evicted, is a miss for
the whole block).  Each hit row and lease carries its directory group; worker ``k`` loads
the rows of its shard (``LoadBatch.for_shard``) and releases their leases.  Worker ``k`` of
the loading replica reads shard ``k`` of a source replica (shard ``k`` of each position may
come from a different source replica: every replica holds the same bytes of a prefix).
With ``tp_size == 1`` a directory group is the KV-cache group (unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class Shards:
    """How a replica's KV-cache groups and TP workers map to directory groups."""

    num_groups: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise ValueError(f"num_groups: at least one KV-cache group, got {self.num_groups}")
        if self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tp_size}")

    def directory_group(self, group: int, tp_rank: int) -> int:
        """The directory group of KV-cache group ``group`` held by TP worker ``tp_rank``."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: {tp_rank} outside tensor_parallel_size {self.tp_size}")
        return group * self.tp_size + tp_rank

    def kv_group(self, directory_group: int) -> int:
        """The KV-cache group of a directory group."""
        return directory_group // self.tp_size

    def tp_rank(self, directory_group: int) -> int:
        """The TP worker that holds a directory group."""
        return directory_group % self.tp_size

    @property
    def directory_groups(self) -> List[int]:
        """Every directory group of the replica (a lookup asks for all of them)."""
        return list(range(self.num_groups * self.tp_size))
