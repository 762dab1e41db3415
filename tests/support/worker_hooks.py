"""Test-only switches and readers of a worker's data plane.

Faults a real engine cannot be made to produce on demand, and digests that let a test
compare bytes across replicas.  They exist only when the engine's environment has
``XAVIER_TEST_HOOKS=tests.support.worker_hooks:WorkerHooks`` (the test harness sets it); a
production worker has no hooks and refuses the calls.  Reached through vLLM's
``collective_rpc("xavier_hook", ...)`` (``vllm_side/worker_extension.py``), with
plain values in and out.

* faults: ``skip_copy`` (the step's loads claim success but copy nothing: the destinations
  are zeroed -- the negative control), ``fail_one_block`` (one block of the step is zeroed
  and reported failed: vLLM must recompute it), ``stall_load`` (the step's load waits
  :data:`STALL_LOAD_S` after its leases were granted, before any peer is mapped or byte
  copied: the window in which a test kills the source), ``hold_finish`` (the step's loads
  are done but reported to vLLM only :data:`HOLD_FINISH_S` later: the window in which a
  test aborts a request whose load vLLM still waits for), ``hold_load`` (armed with
  :meth:`WorkerHooks.hold_next_load`: the step's load waits, rows built, nothing copied,
  until a release file appears -- the window in which a test makes the source reuse the
  blocks the rows name; a file, because vLLM's RPCs to this worker wait for the step);
  ``set_read_checks`` switches the check of every read after its copy off and on (the
  negative control of the tests that show it is needed);
* readers: SHA-256 of engine blocks, of stored blocks, of the blocks recent loads wrote.

Loaded in vLLM's worker process, so it imports the package by its installed name
(``_xinference_xavier_fork``, as vLLM loads the connector): the same modules, without
upstream's ``xinference.model``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from _xinference_xavier_fork.planning.load_batch import DEST, GROUP, KEY, LoadBatch

if TYPE_CHECKING:  # pragma: no cover
    from _xinference_xavier_fork.vllm_side.worker_plane import WorkerDataPlane

FAULTS = ("skip_copy", "fail_one_block", "stall_load", "hold_finish", "hold_load")
#: longest a ``hold_load`` waits for its release file
HOLD_LOAD_MAX_S = 120.0
STALL_LOAD_S = 3.0
#: how long a ``hold_finish`` fault keeps the step's loads from being reported finished
HOLD_FINISH_S = 3.0
RECENT = 4096


class WorkerHooks:
    def __init__(self, plane: WorkerDataPlane) -> None:
        self._plane = plane
        self._faults: Dict[str, int] = {}
        self._recent_loads: OrderedDict[Tuple[int, int], int] = OrderedDict()
        self._recent_exports: OrderedDict[Tuple[int, int], int] = OrderedDict()
        self._recent_in_place: OrderedDict[Tuple[int, int], int] = OrderedDict()
        self.fault_blocks: List[Tuple[int, int]] = []
        self._hold_until = 0.0
        self._release_path = ""

    def switch_interval_us(self) -> int:
        """The engine process's GIL switch interval (µs)."""
        import sys

        return int(round(sys.getswitchinterval() * 1e6))

    def set_switch_interval_us(self, us: int) -> int:
        """``sys.setswitchinterval`` of the engine process (the serving benchmark's GIL
        experiment); returns the previous interval in µs."""
        import sys

        old = int(round(sys.getswitchinterval() * 1e6))
        sys.setswitchinterval(int(us) / 1e6)
        return old

    def quiet_spell(self) -> Tuple[float, float]:
        """The worker's quiet gate: ``(quiet_s, max_defer_s)`` (``XavierEngine.set_quiet_ms``
        sets them)."""
        assert self._plane.writer is not None, "the data plane is not attached"
        gate = self._plane.writer.quiet
        return gate.quiet_s, gate.max_defer_s

    # ----------------------------------------------------------------- faults
    def inject_fault(self, mode: str, count: int = 1, tp_rank: int = -1) -> None:
        """Arm ``mode`` for the next ``count`` loads (``tp_rank``: only in that worker of a
        tensor-parallel replica; -1: every worker)."""
        if mode not in FAULTS:
            raise ValueError(f"mode: expected one of {FAULTS}, got {mode!r}")
        if tp_rank in (-1, self._plane.tp_rank):
            self._faults[mode] = int(count)

    def tp_rank(self) -> int:
        return self._plane.tp_rank

    def _take(self, mode: str) -> bool:
        if self._faults.get(mode, 0) <= 0:
            return False
        self._faults[mode] -= 1
        self._plane.counters.add(f"faults_{mode}")
        return True

    def hold_next_load(self, release_path: str) -> None:
        """The next load with rows waits (rows built, nothing copied) until
        ``release_path`` exists (at most :data:`HOLD_LOAD_MAX_S`)."""
        self._release_path = str(release_path)
        self._faults["hold_load"] = 1

    def set_read_checks(self, on: bool) -> bool:
        """Check every read after its copy (True: the product's behaviour) or not; returns
        the previous setting."""
        completion = self._plane.engine._completion
        old = bool(completion.validate_reads)
        completion.validate_reads = bool(on)
        return old

    def before_load(self, batch: LoadBatch) -> None:
        if batch.num_rows and self._take("hold_load"):
            end = time.monotonic() + HOLD_LOAD_MAX_S
            while not os.path.exists(self._release_path) and time.monotonic() < end:
                time.sleep(0.02)
        if batch.num_rows and self._take("stall_load"):
            time.sleep(STALL_LOAD_S)
        if batch.num_rows and self._take("hold_finish"):
            self._hold_until = time.monotonic() + HOLD_FINISH_S

    def holding(self) -> bool:
        """Whether loads must not be reported finished yet (``hold_finish``)."""
        return time.monotonic() < self._hold_until

    def apply_faults(self, batch: LoadBatch, failed: Set[int]) -> Optional[LoadBatch]:
        """The batch to load after the faults (None: nothing to load)."""
        if batch.num_rows and self._take("skip_copy"):
            for g in {int(x) for x in batch.table[:, GROUP]}:
                self._zero(g, batch.table[batch.table[:, GROUP] == g][:, DEST])
            return None  # claims success: nothing reported failed
        if batch.num_rows and self._take("fail_one_block"):
            victim = batch.num_rows // 2
            row = batch.table[victim]
            self._zero(int(row[GROUP]), [int(row[DEST])])  # garbage stays if not redone
            self.fault_blocks.append((int(row[GROUP]), int(row[DEST])))
            failed.add(int(row[DEST]))
            keep = np.ones(batch.num_rows, bool)
            keep[victim] = False
            req = batch.row_request_index()[keep]
            counts = np.bincount(req, minlength=batch.num_requests)
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            batch = LoadBatch(batch.request_ids, offsets, batch.table[keep].copy())
        _remember(self._recent_loads, zip(batch.table[:, GROUP].tolist(),
                                          batch.table[:, KEY].tolist(),
                                          batch.table[:, DEST].tolist()))
        return batch

    def loaded_failed(self, failed: Set[int]) -> None:
        for gk in [gk for gk, b in self._recent_loads.items() if b in failed]:
            del self._recent_loads[gk]

    def exported(self, rows: Sequence[Tuple[int, int, int]]) -> None:
        _remember(self._recent_exports, rows)

    def published_in_place(self, rows: Sequence[Tuple[int, int, int, int]]) -> None:
        _remember(self._recent_in_place, [(g, k, b) for g, k, b, _ in rows])

    def _zero(self, group: int, block_ids: Any) -> None:
        idx = torch.as_tensor(np.asarray(block_ids, np.int64))
        for v in self._plane.engine_views.get(group, []):
            v.index_fill_(0, idx.to(v.device), 0)
        if self._plane.device.type == "cuda":
            torch.cuda.synchronize(self._plane.device)

    # ---------------------------------------------------------------- readers
    def loaded_block_digests(self) -> List[Tuple[int, int, str]]:
        """``(group, key, sha256)`` of the engine blocks recent loads wrote."""
        self._plane.flush()
        views = self._plane.engine_views
        return [(g, k, _digest(views.get(g, []), b)) for (g, k), b in self._recent_loads.items()]

    def stored_block_digests(self, keys: Sequence[Sequence[Any]]) -> List[Tuple[int, str, str]]:
        """``(group, key, sha256)`` of the stored bytes of the ``(group, key)`` blocks this
        rank's storage holds.  Block names (192 bits) cross vLLM's ``collective_rpc``
        (msgpack: at most 64-bit ints) as decimal text, here and in the other readers."""
        self._plane.flush()
        writer = self._plane.writer
        out = []
        views = self._plane.engine_views
        for group, key in keys:
            hit = writer.lookup(int(group), _stored_name(writer, int(group), int(key))
                                ) if writer is not None else None
            if hit is not None and writer is not None:
                tier, slot, _ = hit
                out.append((int(group), str(key),
                            _digest(writer.views(tier, int(group)), slot)))
                continue
            block = _published_block(self._recent_in_place, int(group), int(key))
            if block is not None:  # held in place: the engine block it was published from
                out.append((int(group), str(key), _digest(views[int(group)], block)))
        return out

    def stored_vs_engine_mismatches(self) -> List[Tuple[int, int]]:
        """Recently exported ``(group, key)`` whose stored bytes differ from the engine block
        they were exported from (empty unless wrong KV was published, or vLLM has since
        reused that engine block)."""
        stored = {(g, int(k)): d
                  for g, k, d in self.stored_block_digests(list(self._recent_exports))}
        views = self._plane.engine_views
        return [(g, str(k)) for (g, k), block in self._recent_exports.items()
                if (g, k) in stored and stored[(g, k)] != _digest(views[g], block)]

    def engine_block_digests(self, group: int, block_ids: Sequence[int]) -> List[str]:
        views = self._plane.engine_views.get(int(group), [])
        return [_digest(views, int(b)) for b in block_ids]

    def engine_block_is_zero(self, group: int, block_id: int) -> bool:
        views = self._plane.engine_views.get(int(group), [])
        return all(not bool(v[int(block_id)].any()) for v in views)

    def engine_groups(self) -> List[int]:
        """The KV-cache groups the data plane holds views of."""
        return sorted(int(g) for g in self._plane.engine_views)

    def engine_cache_dtypes(self) -> List[str]:
        """The dtypes of vLLM's KV-cache tensors, as the data plane's layout records them
        (all groups; the copies themselves go through integer views of the same bytes)."""
        return sorted({layer.dtype for g in self._plane.layout.groups for layer in g.layers})

    def engine_num_blocks(self, group: int = 0) -> int:
        views = self._plane.engine_views.get(int(group), [])
        return int(views[0].shape[0]) if views else 0

    def recent_export_keys(self) -> List[Tuple[int, str]]:
        """The names of the blocks this worker recently published: exported into its
        storage, or published in place (its own vLLM cache)."""
        return [(g, str(k)) for g, k in [*self._recent_exports, *self._recent_in_place]]

    def recorded_faults(self) -> List[Tuple[int, int]]:
        return list(self.fault_blocks)

    def reset_recent(self) -> None:
        self._recent_exports.clear()
        self._recent_in_place.clear()
        self._recent_loads.clear()
        self.fault_blocks.clear()

    def flush(self) -> None:
        """Every launched load, export publication and lease release done."""
        self._plane.flush()

    def clear_storage(self) -> Dict[str, int]:
        """Forget every block this worker's storage holds (the shared worlds' reset between
        tests, ``tests/support/worlds.py``): each tier's occupied slots are claimed from the
        directory, as eviction claims them, and freed.  Returns the blocks ``cleared`` and
        those ``left`` (a slot the directory refused: still leased by a peer's load)."""
        self._plane.flush()
        writer = self._plane.writer
        if writer is None:
            return {"cleared": 0, "left": 0}
        cleared = left = 0
        for tier, groups in writer._alloc.items():
            for group, alloc in groups.items():
                with writer._lock:
                    slots = sorted(alloc._key_of)
                if not slots:
                    continue
                granted = writer._directory.claim(writer.rank, int(tier), group, slots)
                with writer._lock:
                    for slot in granted:
                        alloc.release(slot)
                cleared += len(granted)
                left += len(slots) - len(granted)
        writer._gauges()
        return {"cleared": cleared, "left": left}

    def raw_load(self, request_ids: Sequence[str], offsets: Any, table: Any) -> Dict[str, Any]:
        """One load with caller-made metadata (bad-input tests), outside vLLM's steps:
        ``failed`` destinations, ``written`` blocks and the ``error`` that refused it
        (metadata that is not a valid batch is refused like the plane refuses it)."""
        from _xinference_xavier_fork.planning.load_batch import LoadBatch, LoadBatchError
        from _xinference_xavier_fork.planning.step_meta import StepMeta

        plane = self._plane
        try:
            batch = LoadBatch(tuple(request_ids), np.asarray(offsets), np.asarray(table))
        except LoadBatchError as exc:
            plane.refuse(str(exc))
            plane.flush()
            return {"failed": [], "written": 0, "error": str(exc)}
        pending, error = plane.run_detached(StepMeta(batch))
        written = 0
        for h in pending.handles:
            try:
                written += h.wait(60).blocks_written
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        failed = set(pending.failed)
        for h in pending.handles:
            failed |= h.failed
        plane.flush()
        return {"failed": sorted(failed), "written": written, "error": error}


def _stored_name(writer: Any, group: int, key: int) -> int:
    """The full name of the stored block of ``group`` whose name or load-row key (its low
    63 bits) is ``key`` (loads report row keys); ``key`` itself when none is stored."""
    from _xinference_xavier_fork.planning.block_names import row_key

    if writer.lookup(group, key) is not None:
        return key
    for allocs in writer._alloc.values():
        for name in allocs[group]._lru:
            if row_key(name) == key:
                return int(name)
    return key


def _published_block(recent: OrderedDict[Tuple[int, int], int], group: int,
                     key: int) -> Optional[int]:
    """The engine block a recent in-place publication of ``group``'s block named ``key``
    (or whose load-row key, its low 63 bits, is ``key``) came from; None if none."""
    from _xinference_xavier_fork.planning.block_names import row_key

    if (group, key) in recent:
        return recent[(group, key)]
    return next((b for (g, name), b in recent.items() if g == group and row_key(name) == key),
                None)


def _digest(views: Sequence[torch.Tensor], block: int) -> str:
    h = hashlib.sha256()
    for v in views:
        h.update(v[block].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _remember(recent: OrderedDict[Tuple[int, int], int],
              rows: Iterable[Tuple[int, int, int]]) -> None:
    for group, key, block in rows:
        gk = (int(group), int(key))
        recent[gk] = int(block)
        recent.move_to_end(gk)
    while len(recent) > RECENT:
        recent.popitem(last=False)
