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

Which victims are saved is a policy (``xavier_save_victims``, :meth:`InPlaceBook.take_saves`):
never one a same-host peer holds in its vLLM cache then (the last copy on the host is the
one saved); by default (``shared``) only one shown to be shared -- a load of this replica
wrote it (:meth:`InPlaceBook.loaded`), or a same-host peer held it once (its host index
still names it; without host indexes, ``xavier_host_index`` off, only the first) -- since a save
costs the step that hands the block out and a block nobody else ever wanted is rarely
asked for later (session 31: every save of the steady-state benchmark served nobody).
"""

from __future__ import annotations

from typing import Callable, Collection, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np

from .shards import Shards
from .step_meta import ExportRow, InPlaceRow

#: ``xavier_save_victims``: the policies :meth:`InPlaceBook.take_saves` knows (options parses them)
SAVE_POLICIES = ("shared", "all", "off")


class PeerHolding(NamedTuple):
    """For each victim: whether a same-host peer holds it in its vLLM cache now, and whether
    one held it now or once (its entry, maybe stale, is still in the peer's host index)."""

    now: np.ndarray
    ever: np.ndarray


class Saves(NamedTuple):
    """One step's saves (:meth:`InPlaceBook.take_saves`) and the victims left unsaved:
    held by a same-host peer then, or (policy ``shared``) never shown to be shared."""

    rows: Tuple[ExportRow, ...]
    held_elsewhere: int = 0
    never_shared: int = 0


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
        #: blocks whose bytes a load of this replica wrote (until handed out again), and
        #: those of the victims
        self._loaded: Set[int] = set()
        self._loaded_victims: Set[int] = set()
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
        pop, loaded, blocks = self._published.pop, self._loaded, ids.tolist()
        handed = [(block, pub) for block in blocks if (pub := pop(block, None)) is not None]
        if loaded:  # (blocks a load wrote: shown shared until handed out again)
            victims_loaded = loaded.intersection(b for b, _ in handed)
            loaded.difference_update(blocks)
            self._loaded_victims.update(victims_loaded)
        if not handed:
            return
        now = self._rows[0][np.fromiter((b for b, _ in handed), np.int64, len(handed))]
        forgotten = self._forgotten
        for (block, (group, _, _)), gen in zip(handed, now.tolist()):
            # handed out for the first time since its publication
            forgotten.setdefault(group, []).append((block, gen))
        self._victims.extend((group, name, block) for block, (group, name, _) in handed)
        self.reused += len(handed)

    def loaded(self, block_ids: Sequence[int]) -> None:
        """This step's loads write ``block_ids`` (their destinations, handed out already;
        any load, whatever its source): blocks shown to be shared, saved under the
        ``shared`` policy when handed out again."""
        self._loaded.update(int(b) for b in block_ids)

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
        self._loaded.clear()
        self._loaded_victims.clear()

    def publish(self, blocks: Sequence[ExportRow]) -> Tuple[InPlaceRow, ...]:
        """The step's newly full blocks ``(group, name, block)``: published in place at their
        generation now (the worker registers them once the step's forward completed)."""
        if not blocks:
            return ()
        ids = np.fromiter((int(b) for _, _, b in blocks), np.int64, len(blocks))
        out = tuple((int(group), int(name), int(block), gen) for (group, name, block), gen
                    in zip(blocks, self._rows[0][ids].tolist()))
        self._published.update((block, (group, name, gen)) for group, name, block, gen in out)
        return out

    def take_victims(self, zeroed: Collection[int] = ()) -> Tuple[ExportRow, ...]:
        """Published blocks handed out since the last call: to be saved into Xavier's tier
        before anything of the step writes them; ``zeroed``: blocks vLLM zeroes before that
        (never saved: their bytes are gone)."""
        return self._take(zeroed)[0]

    def _take(self, zeroed: Collection[int]) -> Tuple[Tuple[ExportRow, ...], Set[int]]:
        victims, self._victims = self._victims, []
        loaded, self._loaded_victims = self._loaded_victims, set()
        return tuple(v for v in victims if v[2] not in zeroed), loaded

    def take_saves(self, zeroed: Collection[int], policy: str,
                   peers: Optional[Callable[[Sequence[ExportRow]], PeerHolding]] = None
                   ) -> Saves:
        """The victims to save this step (:meth:`take_victims`) under ``policy``
        (``xavier_save_victims``): ``off`` none; ``all`` every one but those ``peers`` says
        a same-host peer holds now (the last copy on the host is the one saved); ``shared``
        of those, only the ones shown to be shared (loaded here, or held by a same-host
        peer once).  The victims are taken whatever the policy (the book keeps none across
        steps)."""
        if policy not in SAVE_POLICIES:
            raise ValueError(f"xavier_save_victims: expected one of {', '.join(SAVE_POLICIES)}, "
                             f"got {policy!r}")
        victims, loaded = self._take(zeroed)
        if policy == "off" or not victims:
            return Saves(())
        n = len(victims)
        holding = peers(victims) if peers is not None else PeerHolding(
            np.zeros(n, bool), np.zeros(n, bool))
        keep = ~holding.now
        never_shared = 0
        if policy == "shared":
            shared = holding.ever
            if loaded:
                shared = shared | np.fromiter((v[2] in loaded for v in victims), bool, n)
            never_shared = int(np.count_nonzero(keep & ~shared))
            keep &= shared
        rows = tuple(v for v, k in zip(victims, keep.tolist()) if k)
        return Saves(rows, int(np.count_nonzero(holding.now)), never_shared)

    def take_forgotten(self) -> Dict[int, List[Tuple[int, int]]]:
        """Directory group -> ``(block, generation now)`` whose in-place entries must go
        (handed out since the last call), for every shard of the replica."""
        forgotten, self._forgotten = self._forgotten, {}
        out: Dict[int, List[Tuple[int, int]]] = {}
        for group, blocks in forgotten.items():
            for shard in range(self._shards.tp_size):
                out[self._shards.directory_group(group, shard)] = list(blocks)
        return out
