"""What one vLLM worker of a rank registered with the rank's ``TransferActor``: a *shard*
(the worker's KV heads; the whole cache without tensor parallelism).

:class:`RankShard` holds the shard's snapshot storage, its staging rows for reads from
other hosts, the worker's pid (``None`` once released), the counters file it shares with
the actor and -- with ``xavier_in_place`` -- how peers map the worker's own vLLM KV cache
(:class:`~.in_place.CacheHandles`), which the actor itself opens on the first read a peer
of another host asks for (:meth:`RankShard.source`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from ..planning.counters import SharedCounters
from ..planning.load_batch import Tier
from .in_place import CacheHandles, InPlaceSource
from .remote_fetch import StagingSets
from .snapshot_storage import SnapshotStorage


@dataclass
class RankShard:
    """See the module docstring."""

    storage: SnapshotStorage
    staging: Optional[StagingSets]
    owner: Optional[int]
    counters: Optional[SharedCounters]
    in_place: Optional[CacheHandles] = None
    _source: Optional[InPlaceSource] = None

    def descriptor(self, host: str) -> Dict[str, Any]:
        """How a peer maps (same host) or reads (other hosts) this shard."""
        desc = {"host": host, "layout": self.storage.layout, "tiers": self.storage.handles(),
                "generations": self.storage.generations_handle()}
        if self.in_place is not None:
            desc["in_place"] = self.in_place
        return desc

    def source(self, tier: int) -> Union[SnapshotStorage, InPlaceSource]:
        """What serves reads of ``tier`` for peers on other hosts: the snapshot storage, or
        the worker's vLLM cache (mapped here on first use)."""
        if Tier(tier) != Tier.VLLM:
            return self.storage
        if self.in_place is None:
            raise LookupError("tier VLLM: this worker's vLLM cache is not shared in place")
        if self._source is None:
            self._source = InPlaceSource(self.in_place)
        return self._source

    def release_in_place(self) -> bool:
        """The worker went: its cache is no longer served (the worker removed its files).
        Returns whether it had shared one."""
        had, self.in_place = self.in_place is not None, None
        if self._source is not None:
            self._source.close()
            self._source = None
        return had

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None
        self.storage.close()
        if self.staging is not None:
            self.staging.close()
        if self.counters is not None:
            self.counters.close()
