"""vLLM's own KV cache as the first tier, read in place: the scheduler side's book (pure).

A replica publishes the blocks its forward computed as ``(name -> its own vLLM block id,
generation)``, with no copy; a peer of the host reads them straight from its KV cache
(``Tier.VLLM``) and checks the generation after its copy (:mod:`~..mechanism.
read_checks`).  That is safe because of ONE ordering (``doc/validated-reads.md``, "The
in-place tier"): **a block's generation is bumped before vLLM can write the block** --
when vLLM's block pool hands it out (:meth:`InPlaceBook.handed_out`, called inside
``BlockPool.get_new_blocks`` before the blocks reach vLLM: every reuse of a block goes
through it, and the step that writes them is launched only after ``schedule()``
returned).  A reader whose copy overlapped an overwrite therefore finds another
generation when it checks.

:class:`InPlaceBook` (scheduler thread only) keeps

* the engine's generations (one row per TP worker's file: each worker owns the file its
  peers map with its cache; they are bumped alike);
* which blocks it published, at which generation (:meth:`publish`: the step's newly full
  blocks, published by the worker after the forward that computed them completed);
* the published blocks vLLM handed out since the last step: their directory entries go
  (:meth:`take_forgotten`, with the generation they have now, so that a late registration
  of the old one is refused), and they are *victims*: the worker saves them into Xavier's
  snapshot tier before anything of the step writes them (:meth:`take_victims`) -- except
  those vLLM itself zeroes first (``new_block_ids_to_zero``: their bytes are gone before
  the worker's first hook of the step).
"""

from __future__ import annotations

from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .shards import Shards
from .step_meta import ExportRow, InPlaceRow


class InPlaceBook:
    """See the module docstring.  ``rows``: the generations of the engine's blocks as this
    process maps them (one ``int64`` per vLLM block id, per TP worker); ``shards``: how
    KV-cache groups map to directory groups (forgotten entries are named per shard)."""

    def __init__(self, rows: Sequence[np.ndarray], shards: Shards) -> None:
        if not rows:
            raise ValueError("rows: at least one generations row (one per TP worker)")
        self._rows = list(rows)
        self._shards = shards
        #: block id -> (group, name, generation) as published
        self._published: Dict[int, Tuple[int, int, int]] = {}
        self._victims: List[ExportRow] = []
        #: group -> (block, generation now) handed out since the last step
        self._forgotten: Dict[int, List[Tuple[int, int]]] = {}
        self.bumped = 0
        #: published blocks handed out again (their entries forgotten)
        self.reused = 0

    @property
    def num_blocks(self) -> int:
        return int(len(self._rows[0]))

    @property
    def published(self) -> int:
        return len(self._published)

    def generation(self, block: int) -> int:
        return int(self._rows[0][block])

    def handed_out(self, block_ids: Sequence[int]) -> None:
        """vLLM's pool hands ``block_ids`` out to be written: bump their generations NOW
        (before vLLM can launch anything that writes them), and note the published ones."""
        if not len(block_ids):
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        for row in self._rows:
            row[ids] += 1
        self.bumped += len(ids)
        for block in ids.tolist():
            pub = self._published.pop(block, None)
            if pub is None:
                continue
            group, name, _ = pub  # handed out for the first time since its publication
            self._forgotten.setdefault(group, []).append((block, self.generation(block)))
            self._victims.append((group, name, block))
            self.reused += 1

    def reset(self) -> None:
        """vLLM dropped its whole prefix cache (``reset_prefix_cache``: e.g. new weights, so
        the bytes no longer match their names): every block is a new generation, nothing
        published stays, nothing is saved."""
        for row in self._rows:
            row[:] += 1
        for block, (group, _, _) in self._published.items():
            self._forgotten.setdefault(group, []).append((block, self.generation(block)))
            self.reused += 1
        self._published.clear()
        self._victims.clear()

    def publish(self, blocks: Sequence[ExportRow]) -> Tuple[InPlaceRow, ...]:
        """The step's newly full blocks ``(group, name, block)``: published in place at their
        generation now (the worker registers them once the step's forward completed)."""
        out: List[InPlaceRow] = []
        for group, name, block in blocks:
            gen = self.generation(block)
            self._published[int(block)] = (int(group), int(name), gen)
            out.append((int(group), int(name), int(block), gen))
        return tuple(out)

    def take_victims(self, zeroed: Collection[int] = ()) -> Tuple[ExportRow, ...]:
        """Published blocks handed out since the last call: to be saved into Xavier's tier
        before anything of the step writes them; ``zeroed``: blocks vLLM zeroes before that
        (never saved: their bytes are gone)."""
        victims, self._victims = self._victims, []
        return tuple(v for v in victims if v[2] not in zeroed)

    def take_saves(self, zeroed: Collection[int], save: bool,
                   held_elsewhere: Optional[Callable[[Sequence[ExportRow]], np.ndarray]] = None
                   ) -> Tuple[Tuple[ExportRow, ...], int]:
        """The victims to save this step (:meth:`take_victims`; none unless ``save``), but
        those ``held_elsewhere`` says a same-host peer holds in its vLLM cache now (the last
        copy on the host is the one saved), and how many of those there were.  The victims
        are taken either way (the book keeps none across steps)."""
        victims = self.take_victims(zeroed)
        if not save or not victims or held_elsewhere is None:
            return (victims if save else ()), 0
        held = held_elsewhere(victims).tolist()
        return tuple(v for v, h in zip(victims, held) if not h), int(sum(held))

    def take_forgotten(self) -> Dict[int, List[Tuple[int, int]]]:
        """Directory group -> ``(block, generation now)`` whose in-place entries must go
        (handed out since the last call), for every shard of the replica."""
        forgotten, self._forgotten = self._forgotten, {}
        out: Dict[int, List[Tuple[int, int]]] = {}
        for group, blocks in forgotten.items():
            for shard in range(self._shards.tp_size):
                out[self._shards.directory_group(group, shard)] = list(blocks)
        return out
