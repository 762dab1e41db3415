"""The block directory's leases (pure): what keeps a slot of Xavier's tiers from being
reused while a load reads it.  Granted and given back in one place, :class:`Leases`
(a query or :meth:`~.block_directory.BlockDirectory.lease` grants, ``release`` gives
back; a lease older than ``ttl_s`` is dropped, and so are a departed rank's).

A lease id is drawn at random (62 bits, never :data:`~.load_batch.NO_LEASE`): another
party cannot guess a replica's lease to free it, and a release that outlived an older
directory incarnation (a re-created supervisor actor) names none of this one's, with a
chance of about (leases outstanding) / 2**62 of the contrary.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

from .directory_types import DirectoryStats, LeaseRecord
from .load_batch import NO_LEASE

#: a leased slot: (rank, place on the rank: :func:`~.directory_entries.place`)
Held = Tuple[int, int]
LEASE_ID_BITS = 62


class Leases:
    """Outstanding leases, in the order granted (the oldest first), and how many each slot
    has; counted in ``stats``."""

    def __init__(self, max_leases: int, ttl_s: float, clock: Callable[[], float],
                 stats: DirectoryStats) -> None:
        self.max_leases = max_leases
        self.ttl_s = ttl_s
        self.clock = clock
        self.stats = stats
        self._leases: Dict[int, LeaseRecord] = {}
        self._count: Dict[Held, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def counts(self) -> Dict[Held, int]:
        """Slot -> its leases (read only; only slots with leases)."""
        return self._count

    def on(self, held: Held) -> int:
        """Leases on slot ``held``."""
        return self._count.get(held, 0)

    def room_for(self, n: int) -> bool:
        """Whether ``n`` more leases fit under ``max_leases`` (expired ones dropped first)."""
        if n and len(self._leases) + n > self.max_leases:
            self.expire()
        return not n or len(self._leases) + n <= self.max_leases

    def grant(self, slots: Sequence[Held], holder: int) -> List[int]:
        """A lease on each of ``slots``, held by ``holder``."""
        now = self.clock() if slots else 0.0
        ids = []
        for held in slots:
            lease_id = secrets.randbits(LEASE_ID_BITS)
            while lease_id == NO_LEASE or lease_id in self._leases:
                lease_id = secrets.randbits(LEASE_ID_BITS)
            self._leases[lease_id] = LeaseRecord(held, holder, now)
            self._count[held] = self._count.get(held, 0) + 1
            ids.append(lease_id)
        self.stats.leases_granted += len(ids)
        return ids

    def release(self, lease_ids: Iterable[int]) -> int:
        """Give leases back; unknown ids (already released, a purged rank's, another
        incarnation's) are counted, not errors.  Returns how many were released."""
        released = 0
        for lease_id in lease_ids:
            if lease_id == NO_LEASE:  # a location read in place: nothing was leased
                continue
            if lease_id not in self._leases:
                self.stats.unknown_releases += 1
                continue
            self._drop([lease_id])
            released += 1
        self.stats.leases_released += released
        return released

    def expire(self) -> int:
        """Drop the leases older than ``ttl_s`` (oldest first; stops at the first younger
        one); returns how many went."""
        deadline = self.clock() - self.ttl_s
        old = list(itertools.takewhile(lambda i: self._leases[i].granted_at < deadline,
                                       self._leases))
        self._drop(old)
        self.stats.leases_expired += len(old)
        return len(old)

    def drop_rank(self, rank: int) -> None:
        """``rank`` went: the leases on its slots, and those it held on others' slots."""
        self._drop([i for i, s in self._leases.items() if s.slot[0] == rank])
        held = [i for i, s in self._leases.items() if s.holder == rank]
        self._drop(held)
        self.stats.leases_of_gone_holders += len(held)

    def _drop(self, lease_ids: Iterable[int]) -> None:
        for lease_id in lease_ids:
            held = self._leases.pop(lease_id).slot
            left = self._count[held] - 1
            if left:
                self._count[held] = left
            else:
                del self._count[held]
