"""How long a peer rank that failed is left alone: doubling with each failure in a row (pure).

One rule for the two places that back off a peer (issue #36): a worker's mappings of peers
(``vllm_side/peers.py``: a peer a load asked for that could not be mapped) and its reads of
other hosts (``vllm_side/remote_reads.py``: a peer whose read failed is left out of loads).
"""

from __future__ import annotations

from typing import Callable, Dict


class RankBackoff:
    """Per rank: after a failure, ``base_s`` seconds, doubled with each failure in a row up
    to ``max_s``; a failure more than ``max_s`` after the last wait ended starts again from
    ``base_s``; :meth:`forget` (the peer answered, or moved) ends it.  Not thread-safe: the
    caller holds its lock."""

    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float]) -> None:
        if not 0 < base_s <= max_s:
            raise ValueError(f"base_s, max_s: expected 0 < {base_s} <= {max_s}")
        self.base_s, self.max_s, self._clock = base_s, max_s, clock
        self._until: Dict[int, float] = {}
        self._in_a_row: Dict[int, int] = {}

    def failed(self, rank: int) -> float:
        """``rank`` failed now: how long it is left alone."""
        now = self._clock()
        if now - self._until.get(rank, now) > self.max_s:
            self._in_a_row.pop(rank, None)  # long ago: start again
        n = self._in_a_row[rank] = self._in_a_row.get(rank, 0) + 1
        wait = min(self.max_s, self.base_s * 2 ** (n - 1))
        self._until[rank] = now + wait
        return wait

    def waiting(self, rank: int, now: float) -> bool:
        """Whether ``rank`` is still left alone at ``now``."""
        return self._until.get(rank, 0.0) > now

    def forget(self, rank: int) -> None:
        self._until.pop(rank, None)
        self._in_a_row.pop(rank, None)

    def __bool__(self) -> bool:
        return bool(self._until)
