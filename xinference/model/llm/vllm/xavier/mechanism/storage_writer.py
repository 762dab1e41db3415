"""This rank's snapshot storage as its vLLM worker writes it: slots, exports, room.

The storage's memory belongs to the rank's ``TransferActor`` (:mod:`.snapshot_storage`);
the worker maps every tier and keeps the books (a :class:`~..planning.slot_allocator.
SlotAllocator` per tier and group: each slot's key, LRU order, generations).

:meth:`StorageWriter.export` runs on the worker's step thread and never waits: blocks
already stored (any tier) are only touched (LRU); free slots of the top tier are taken in
O(1) (a block that finds none is skipped: a later miss, ``export_skipped_no_slot``); the
copies are queued on the engine's copy stream after the forward that computed them (one
fused gather per group on CUDA), and the caller's stream waits for them, so vLLM cannot
overwrite a block before it was read.  A step's victims (``after_forward=False``) are
copied on a stream of their own, not after the forward in flight (which writes none: vLLM
defers freeing a block a step in flight may write).  The publisher thread registers the
blocks after the copies' event (one call per export): never visible before their bytes.

The room thread keeps two steps' saves of free top-tier slots: it demotes LRU victims one tier
down (in chunks, on its own stream, after the last export's copies), registers them there and
claims the victims (a leased slot is refused and kept), never one whose publication is pending
(a claim must not overtake the registration it would undo).  Its rounds and the publisher's
directory calls wait until no load or save was launched for a while (:mod:`.quiet_gate`),
unless the tier is short of the next step's save (free under half the target: a hit's save
alone leaves its round waiting); a wake with nothing to free makes no round.

A CPU engine's CPU tier is written by the step thread directly; a CUDA engine's
page-locked one in place through CUDA views (:mod:`.uva`), by demotions from few thread
blocks (:func:`~..planning.options.room_copy_programs`), or without views
(``XAVIER_UVA=0``) by a device gather and a copy into page-locked rows, scattered on the
host after."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch

from ..planning.counters import Counters, CounterSink, elapsed_us
from ..planning.directory_link import DirectoryLink, Entry, ExportRow
from ..planning.load_batch import Tier
from ..planning.log_names import package_logger
from ..planning.options import room_copy_programs
from ..planning.slot_allocator import (
    SlotAllocator,
    place_new,
    rows_by_group,
    take_free_slots,
)
from ..planning.trace_spans import span
from . import block_copy_triton
from .block_copy import block_view, copy_rows, gather_to_pinned, slab_as
from .kv_schema import KVLayout
from .publisher import Publication, Publisher
from .quiet_gate import QuietGate
from .slot_generations import SlotGenerations
from .uva import cuda_views

logger = package_logger(__name__)

#: blocks a room round demotes and claims (per group); slots kept free, in saves of room_blocks
ROOM_CHUNK_BLOCKS, ROOM_TARGET_SAVES = 512, 2
#: how often the room thread looks even when no export woke it
ROOM_PERIOD_S = 0.5


@dataclass
class ExportResult:
    """What one export did."""

    exported: int = 0
    already_stored: int = 0
    skipped_no_slot: int = 0
    #: the end of its copies on the engine's copy stream (CUDA, when anything was copied)
    event: Optional[torch.cuda.Event] = None


class StorageWriter:
    """See the module docstring.  ``tiers``: this rank's mapped tiers, top first, each
    ``{group: [layer tensor [slots, *block_shape]]}``; ``generations``: the storage's slot
    generations as this process maps them (:mod:`.slot_generations`; readers check them),
    private ones when None."""

    def __init__(self, rank: int, layout: KVLayout,
                 tiers: Dict[Tier, Dict[int, List[torch.Tensor]]],
                 directory: DirectoryLink, device: torch.device,
                 stream: Optional[torch.cuda.Stream] = None,
                 counters: Optional[CounterSink] = None, room_blocks: int = 512,
                 background_room: bool = True, generations: Optional[SlotGenerations] = None,
                 quiet: Optional[QuietGate] = None) -> None:
        if not tiers:
            raise ValueError("tiers: at least one storage tier is needed")
        self.rank, self.layout, self.device, self.stream = rank, layout, device, stream
        self.sink: CounterSink = counters if counters is not None else Counters()
        self._directory = directory
        self.incarnation = generations.incarnation if generations is not None else 0  # (rows')
        self._order = sorted(tiers)
        #: page-locked host tiers of a CUDA engine, kept alive while their CUDA views are
        #: written and read in place (:mod:`.uva`)
        self._host_tiers: Dict[Tier, Dict[int, List[torch.Tensor]]] = {}
        tiers = dict(tiers)
        for tier, groups in list(tiers.items()):
            views = cuda_views(groups, device)
            if views is not None:
                self._host_tiers[tier], tiers[tier] = groups, views
                self.sink.add("uva_tiers_written")
        self._views = {t: {g: [block_view(x, 0) for x in layers] for g, layers in groups.items()}
                       for t, groups in tiers.items()}
        self._slots = {t: min(layers[0].shape[0] for layers in groups.values())
                       for t, groups in tiers.items()}
        self._alloc: Dict[Tier, Dict[int, SlotAllocator]] = {
            t: {g.group: SlotAllocator(self._slots[t], None if generations is None
                                       else generations.row(int(t), g.group))
                for g in layout.groups} for t in tiers}
        self._copier = block_copy_triton.FusedCopier(device)  # exports and demotions
        self._room_programs = room_copy_programs(os.environ)
        self._lock = threading.Lock()
        self._pending: Set[Tuple[int, int]] = set()  # (group, key) exported, not yet published
        self._last_event: Optional[torch.cuda.Event] = None
        #: victims' copies: a stream of their own, not behind the exports that wait for
        #: the forward in flight (high priority: a load may wait for them)
        self._save_stream = None if stream is None else torch.cuda.Stream(device, priority=-1)
        self._last_save_event: Optional[torch.cuda.Event] = None
        self._room_target = min(ROOM_TARGET_SAVES * room_blocks, self._slots[self._order[0]] // 4)
        self._wake, self._idle = threading.Event(), threading.Event()  # (idle: set)
        self._idle.set()  # the room thread is not in a round
        self._unpublished, self._closed = 0, False
        self._room_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        #: holds the room's rounds and the publisher's directory calls back (module docstring)
        self.quiet = quiet if quiet is not None else QuietGate(0.0, sink=self.sink)
        self._publisher = Publisher(rank, directory, self.incarnation, self.sink,
                                    self._published, self.quiet)
        self._room = threading.Thread(target=self._room_loop, daemon=True,
                                      name=f"xavier-room-{rank}") if (
            background_room and self._room_target > 0) else None
        if self._room is not None:
            self._room.start()
        self._gauges()

    # ------------------------------------------------------------------ views
    @property
    def tiers(self) -> List[Tier]:
        return list(self._order)

    def slots(self, tier: Tier) -> int:  # (per group)
        return self._slots[Tier(tier)]

    def used(self, tier: Tier) -> int:
        with self._lock:
            return sum(a.used for a in self._alloc[Tier(tier)].values())

    def free(self, tier: Tier, group: int = 0) -> int:
        with self._lock:
            return self._alloc[Tier(tier)][group].free

    def lookup(self, group: int, key: int) -> Optional[Tuple[Tier, int, int]]:
        """``(tier, slot, generation)`` of a stored block (top tier first), or None."""
        with self._lock:
            for tier in self._order:
                hit = self._alloc[tier][group].lookup(key, touch=False)
                if hit is not None:
                    return tier, hit[0], hit[1]
        return None

    def views(self, tier: Tier, group: int) -> List[torch.Tensor]:
        return self._views[Tier(tier)][group]

    # ----------------------------------------------------------------- export
    def export(self, engine_views: Dict[int, List[torch.Tensor]],
               rows: Sequence[ExportRow], after_forward: bool = True) -> ExportResult:
        """Store newly computed full blocks ``(group, key, engine block)`` (engine views as
        :func:`~.block_copy.block_view` gives), or victims (``after_forward=False``); see
        the module docstring.  Never waits."""
        if self._closed:
            raise RuntimeError(f"export: the storage writer of rank {self.rank} is closed")
        res = ExportResult()
        top = self._order[0]
        placed: Dict[int, Tuple[List[int], List[int]]] = {}  # group -> (blocks, slots)
        entries: List[Entry] = []
        with elapsed_us(lambda us: self.sink.add("export_launch_us", us),
                        lambda us: self.sink.add("export_launch_cpu_us", us)):
            by_group = rows_by_group(rows)
            for group in by_group:  # (before anything is taken)
                if group not in self._alloc[top]:
                    raise ValueError(f"group: KV-cache group {group} is not stored")
            with self._lock:
                for group, group_rows in by_group.items():
                    got = place_new([self._alloc[t][group] for t in self._order], group_rows)
                    res.already_stored += got.already_stored
                    res.skipped_no_slot += got.skipped_no_slot
                    if got.slots:
                        placed[group] = (got.blocks, got.slots)
                        entries.extend((group, k, int(top), slot, gen) for k, slot, gen
                                       in zip(got.keys, got.slots, got.generations))
                        self._pending.update((group, k) for k in got.keys)
            if entries:
                pub = Publication(entries, [(g, k) for g, k, _, _, _ in entries])
                res.event = self._copy_out(engine_views, top, placed, pub, after_forward)
                with self._lock:
                    self._unpublished += 1
                self._publisher.put(pub)
        res.exported = len(entries)
        for name, value in (("export_calls", 1), ("export_exported", res.exported),
                            ("export_already_stored", res.already_stored),
                            ("export_skipped_no_slot", res.skipped_no_slot)):
            self.sink.add(name, value)
        if res.exported or res.skipped_no_slot:
            self._wake.set()  # (the room round itself waits: :mod:`.quiet_gate`)
        self._gauges()
        return res

    def _copy_out(self, engine_views: Dict[int, List[torch.Tensor]], tier: Tier,
                  placed: Dict[int, Tuple[List[int], List[int]]], pub: Publication,
                  after_forward: bool = True) -> Optional[torch.cuda.Event]:
        """Queue the copies engine blocks -> ``tier`` slots (see the module docstring);
        the event that marks their end (None on a CPU engine: copied now)."""
        if self.stream is None:  # CPU engine: copy now
            for group, (blocks, slots) in placed.items():
                copy_rows(engine_views[group], self._views[tier][group], blocks, slots)
            return None
        caller = torch.cuda.current_stream(self.device)
        stream = self.stream if after_forward else self._save_stream
        assert stream is not None
        if after_forward:  # (a victim's copy need not wait: the module docstring)
            stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for group, (blocks, slots) in placed.items():
                src, dst = engine_views[group], self._views[tier][group]
                if dst[0].device.type == "cuda":
                    self._copier.copy(("engine", group), src, (tier, group), dst, blocks,
                                         slots)
                else:  # CPU top tier without a CUDA view: gather, then into page-locked
                    # rows; the publisher scatters them
                    host = gather_to_pinned(src, blocks, self.device)
                    pub.scatter.append((dst, torch.tensor(slots, dtype=torch.int64), host))
            event = torch.cuda.Event()
            event.record(stream)
        caller.wait_event(event)  # vLLM reuses none of these blocks before they were read
        pub.event = event
        if after_forward:
            self._last_event = event
        else:
            self._last_save_event = event
        return event

    # ------------------------------------------------------------ publication
    def publish_after(self, entries: List[Entry], incarnation: int,
                      event: Optional[torch.cuda.Event] = None, local: bool = False) -> None:
        """Register ``entries`` of the storage ``incarnation`` (vLLM's own cache, read in
        place; ``local``: into the host index only, :mod:`.publisher`) once ``event``
        completed (the forward that wrote them), in order with the exports; never waits."""
        if self._closed:
            raise RuntimeError(f"publish: the storage writer of rank {self.rank} is closed")
        with self._lock:
            self._unpublished += 1
        self._publisher.put(Publication(list(entries), [], event, incarnation=incarnation,
                                        local=local))

    def _published(self, pub: Publication) -> None:
        with self._lock:
            self._pending.difference_update(pub.keys)
            self._unpublished -= 1

    # ------------------------------------------------------------------- room
    def _room_loop(self) -> None:
        while not self._closed:
            self._wake.wait(ROOM_PERIOD_S)
            self._wake.clear()
            if self._closed or not self._room_below(1):  # (no round: nothing to free)
                continue
            self._idle.clear()  # (before the gate: a flush during it waits for the round)
            self.quiet.wait(urgent=lambda: self._room_below(0.5))
            try:
                self.make_room()
            except Exception as exc:  # the next round tries again; exports skip meanwhile
                logger.warning("rank %d: making room failed: %r", self.rank, exc)
            finally:
                self._idle.set()

    def make_room(self, free_blocks: Optional[int] = None) -> int:
        """Free up to ``free_blocks`` (default: the room target) slots of the top tier of
        every group: demote LRU victims one tier down, then claim them.  Returns the
        slots freed.  Runs on the room thread (tests may call it directly)."""
        target = self._room_target if free_blocks is None else free_blocks
        top = self._order[0]
        freed, t0 = 0, time.perf_counter()
        for group in self._alloc[top]:
            refused_rounds = 0
            while not self._closed:
                with self._lock:
                    alloc = self._alloc[top][group]
                    need = min(target, alloc.num_slots) - alloc.free
                    if need <= 0:
                        break
                    victims = alloc.victims(min(need, ROOM_CHUNK_BLOCKS),
                                            exclude=self._pending_keys(group))
                if not victims:
                    break
                self.sink.add("room_rounds")
                got = self._evict(top, group, victims)
                freed += got
                if got == 0:
                    refused_rounds += 1
                    if refused_rounds >= 2:
                        break  # everything left is leased: try again later
        if freed:
            self.sink.add("room_us", int(1e6 * (time.perf_counter() - t0)))
        self._gauges()
        return freed

    def _room_below(self, share: float) -> bool:  # (a group's top tier: free < share x target)
        with self._lock:
            return any(a.free < int(share * min(self._room_target, a.num_slots))
                       for a in self._alloc[self._order[0]].values())

    def _pending_keys(self, group: int) -> FrozenSet[int]:
        """Keys of ``group`` exported but not yet published (never victims)."""
        return frozenset(k for g, k in self._pending if g == group)

    def _evict(self, tier: Tier, group: int, victims: List[int]) -> int:
        """Demote ``victims`` of ``tier`` one tier down (if any), then claim them; refused
        (leased) victims are touched so that the next round takes others."""
        lower = [t for t in self._order if t > tier]
        entries = self._demote(tier, lower[0], group, victims) if lower else []
        # one directory call: the lower copies are registered, then the victims claimed
        with elapsed_us(lambda us: self.sink.add("room_directory_us", us)), \
                span(self.rank, "room.directory", blocks=len(victims)):
            granted = self._directory.move(self.rank, entries, int(tier), group, victims,
                                           self.incarnation)
        refused = set(victims) - set(granted)
        with self._lock:
            alloc = self._alloc[tier][group]
            for slot in granted:
                alloc.release(slot)
            for slot in refused:
                key = alloc.key_of(slot)
                if key is not None:
                    alloc.lookup(key, touch=True)
        self.sink.add("room_evicted", len(granted))
        self.sink.add("room_claims_refused", len(refused))
        return len(granted)

    def _demote(self, src_tier: Tier, dst_tier: Tier, group: int,
                victims: List[int]) -> List[Entry]:
        """Copy ``victims``' blocks one tier down; returns the lower copies' entries (the
        caller registers them with the claim of the victims)."""
        with self._lock:
            src_alloc, dst_alloc = self._alloc[src_tier][group], self._alloc[dst_tier][group]
            todo = [(k, s) for s in victims if (k := src_alloc.key_of(s)) is not None
                    and dst_alloc.lookup(k, touch=False) is None]
            slots = take_free_slots(dst_alloc, len(todo))
        if len(slots) < len(todo):  # the lower tier is full too: claim its LRU victims
            with self._lock:
                lower_victims = dst_alloc.victims(len(todo) - len(slots),
                                                  exclude=self._pending_keys(group))
            if lower_victims:
                with elapsed_us(lambda us: self.sink.add("room_directory_us", us)):
                    granted = self._directory.claim(self.rank, int(dst_tier), group,
                                                    lower_victims)
                with self._lock:
                    for slot in granted:
                        dst_alloc.release(slot)
                    slots += take_free_slots(dst_alloc, len(todo) - len(slots))
                self.sink.add("room_evicted", len(granted))
        if len(slots) < len(todo):
            self.sink.add("room_skipped_no_lower_slot", len(todo) - len(slots))
            todo = todo[:len(slots)]
        if not todo:
            return []
        # the slots are assigned (their generations bumped) before the copy writes them:
        # a peer reading what they held before sees the bump when it checks after its copy
        with self._lock:
            gens = dst_alloc.assign_many([k for k, _ in todo], slots)
        try:
            with elapsed_us(lambda us: self.sink.add("room_copy_us", us)), \
                    span(self.rank, "room.copy", blocks=len(todo)):
                self._copy_between(src_tier, dst_tier, group, [s for _, s in todo], slots)
        except BaseException:
            with self._lock:  # never registered: the slots are free again
                for slot in slots:
                    dst_alloc.release(slot)
            raise
        self.sink.add("room_demoted", len(todo))
        return [(group, k, int(dst_tier), slot, gen)
                for (k, _), slot, gen in zip(todo, slots, gens)]

    def _copy_between(self, src_tier: Tier, dst_tier: Tier, group: int,
                      src_slots: List[int], dst_slots: List[int]) -> None:
        """Copy slots between two tiers of this storage, complete on return (room thread),
        after the last export's copies (which may have written the victims)."""
        src, dst = self._views[src_tier][group], self._views[dst_tier][group]
        if self._room_stream is None or src[0].device.type != "cuda":
            copy_rows(src, dst, src_slots, dst_slots)
            return
        with torch.cuda.stream(self._room_stream):
            for last in (self._last_event, self._last_save_event):
                if last is not None:
                    self._room_stream.wait_event(last)
            if dst[0].device.type == "cuda":  # a GPU tier, or a host tier seen through CUDA
                self._copier.copy((src_tier, group), src, (dst_tier, group), dst,
                                     src_slots, dst_slots, programs=self._room_programs
                                     if dst_tier == Tier.CPU else None)
                staged = None
            else:
                staged = gather_to_pinned(src, src_slots, self.device)
            event = torch.cuda.Event()
            event.record(self._room_stream)
        event.synchronize()
        if staged is not None:
            slots = torch.tensor(dst_slots, dtype=torch.int64)
            for d, h in zip(dst, staged):
                d.index_copy_(0, slots, slab_as(h, len(dst_slots), d))

    def _gauges(self) -> None:
        for tier in self._order:
            with self._lock:  # (one hold for both figures: on every export)
                used = sum(a.used for a in self._alloc[tier].values())
                free = sum(a.free for a in self._alloc[tier].values())
            self.sink.set(f"storage_{tier.name.lower()}_used_blocks", used)
            self.sink.set(f"storage_{tier.name.lower()}_free_blocks", free)

    # ------------------------------------------------------------------ close
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every export so far is published and the room thread is idle."""
        end = time.monotonic() + timeout
        with self.quiet.hurried():
            while time.monotonic() < end:
                with self._lock:
                    pending = self._unpublished
                if pending == 0 and self._idle.is_set():
                    return True
                time.sleep(0.005)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Publish what is pending, stop the threads, drop the tier views.  Idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._wake.set()
        self.quiet.close()
        self._publisher.close(timeout)
        if self._room is not None:
            self._room.join(timeout)
        self._views.clear()
        self._host_tiers.clear()
        self._copier.clear()
