"""Xavier's counters: one fixed list of names, an in-process sink, a shared-memory sink that
another process of the host reads when asked, and their Prometheus text.

The data plane runs inside vLLM's worker process, which serves no actor; the rank's
``TransferActor`` (in the replica's sub pool) answers ``counters()``.  So the worker
writes its counters into a small file in ``/dev/shm`` (:class:`SharedCounters`: one
int64 per name) and the actor maps the same file and reads it when asked: nothing is
pushed per step, and a read costs the actor a copy of a few hundred bytes.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Tuple

import numpy as np

from .shm_words import DATA_NAME, ShmWords, shm_dir
from .step_hold import HOLD_COUNTER_NAMES, HOLD_MAX_NAME

#: every counter the worker's data plane and the scheduler side keep, in file order
COUNTER_NAMES: Tuple[str, ...] = (
    # load engine (see TransferCounters)
    "logical_requests", "batch_calls", "transfers", "fused_transfers", "useful_bytes",
    "padded_bytes", "blocks_written", "load_failures", "rejected_batches",
    "lease_release_failures",
    # every read checked after its copy (source rows), those that no longer held the block
    # they were named for (recomputed), and mappings of a source found to be another
    # incarnation than its published rows (dropped, mapped again)
    "reads_validated", "validation_failures", "stale_mappings_dropped",
    # reads that could not be checked (a storage mapped without its generations: tests only)
    "reads_unchecked",
    # the worker's loads
    "rows_from_gpu_tier", "rows_from_cpu_tier", "rows_from_vllm_cache", "rows_unreachable",
    "rejected_metadata",
    "loads_in_background", "load_launch_us", "load_background_us",
    # the launches' CPU time on the step's thread (wall minus this: waiting for the GIL,
    # a lock or the driver), the time spent mapping peers and compiling the copy kernel
    "load_launch_cpu_us", "peer_map_us", "copy_warm_us",
    # loads of device memory reported to vLLM in the step that launched them (vLLM then
    # computes the request one step sooner), the host time their report waited for them,
    # and those still not checked when the wait ran out (reported a step later); the host
    # time steps with no forward waited for loads in flight (instead of going round again)
    "loads_reported_at_once", "report_wait_us", "report_wait_missed", "idle_wait_us",
    # scheduler side (they travel with the step's metadata to the worker)
    "queries", "queried_blocks", "hit_blocks", "hit_tokens", "requests_with_hits",
    "steps_with_loads", "lookup_calls", "lookups_deferred", "lookups_given_up",
    "lookup_wait_us", "scheduler_steps", "scheduler_us", "identity_clashes",
    "hits_started", "hit_lookup_us", "hit_load_wait_us", "null_blocks_skipped",
    # hits answered from same-host peers' host indexes, without a directory lookup
    "host_index_hits", "host_index_blocks",
    # reads of Xavier's tiers the scheduler leased when their step was built
    "leases_asked",
    # the cost model: hits judged not worth loading, those declined (xavier_load_policy
    # cost) and their tokens, requests not looked up since none of their blocks would pay
    "hits_not_paying", "hits_declined", "hit_tokens_declined", "lookups_skipped_not_paying",
    # misses answered at once: no rank of the launch (all on this host) holds the first block
    "lookups_skipped_held_nowhere",
    # vLLM's cache read in place: blocks published (scheduler), published blocks vLLM
    # handed out again and those of them saved into Xavier's tier; the worker's
    # registrations of published blocks (after their forward) and their failures
    "in_place_published", "in_place_reused", "in_place_victims", "in_place_registered",
    "in_place_register_failures",
    # of those registered: into the host index only (the whole launch on this host); the
    # blocks registered again in the directory when that ended
    "in_place_kept_local", "in_place_republished",
    # published blocks vLLM handed out again but not saved: a same-host peer held them,
    # or (xavier_save_victims shared) nothing showed them shared
    "in_place_victims_held_elsewhere", "in_place_victims_never_shared",
    # exports
    "export_calls", "export_exported", "export_already_stored", "export_skipped_no_slot",
    "export_launch_us", "export_launch_cpu_us", "export_published", "export_publish_failures",
    # publications registered together with the one before them (queued while the
    # directory answered it: one call for them all), and steps whose forgets went with an
    # earlier step's (the scheduler keeps one forget call out at a time)
    "directory_calls_coalesced", "forgets_coalesced",
    # background room in the top tier
    "room_rounds", "room_demoted", "room_evicted", "room_claims_refused",
    "room_skipped_no_lower_slot", "room_us",
    # of room_us: copies between tiers (complete on return), directory calls (claim, move)
    "room_copy_us", "room_directory_us",
    # background work (room rounds, the publisher's directory calls) held back until the
    # worker launched no load or save for xavier_quiet_ms (mechanism/quiet_gate.py)
    "background_deferrals", "background_deferred_us",
    # worker steps the connector held longer than 10 / 50 / 250 ms (its scheduler half's
    # time building the step plus its worker half's in it: :mod:`.step_hold`)
    *HOLD_COUNTER_NAMES,
    # peers
    "peers_mapped_ipc", "peers_mapped_nixl", "peers_mapped_sockets", "peer_map_failures",
    "peer_premap_failures", "peers_kept_out", "world_updates_seen",
    # reads of another host abandoned while they waited: their peer left the world
    "remote_reads_abandoned",
    # page-locked host tiers read and written through CUDA views (mechanism/uva.py)
    "uva_storages_mapped", "uva_tiers_written",
    # test-only fault switches (XAVIER_TEST_FAULTS=1)
    "faults_skip_copy", "faults_fail_one_block", "faults_stall_load", "faults_hold_finish",
    "faults_hold_load",
)
#: counters that are levels, not totals (set, not added)
GAUGE_NAMES: Tuple[str, ...] = ("storage_gpu_used_blocks", "storage_cpu_used_blocks",
                                "storage_gpu_free_blocks", "storage_cpu_free_blocks",
                                # the longest load launch so far (µs)
                                "load_launch_max_us",
                                # the longest step hold so far (µs, :mod:`.step_hold`)
                                HOLD_MAX_NAME,
                                # the cost model's latest estimates (0 until first known)
                                "cost_prefill_ns_per_token", "cost_step_fixed_us",
                                "cost_hit_wait_us",
                                # same-host peers whose host indexes the scheduler maps;
                                # 1 while they are the whole launch's (misses answered
                                # without a lookup), else 0
                                "host_index_peers", "host_index_whole_launch",
                                # written by the transfer actor into its worker's file: the
                                # world changed (the worker re-reads it before its next load)
                                "world_epoch")
#: levels a step reports down to 0 (a step that does not know one reports -1); the other
#: levels keep their last known value when a step reports 0 (the cost model's, unknown)
ZERO_LEVELS: Tuple[str, ...] = ("host_index_peers", "host_index_whole_launch")
ALL_NAMES: Tuple[str, ...] = COUNTER_NAMES + GAUGE_NAMES
_INDEX: Dict[str, int] = {name: i for i, name in enumerate(ALL_NAMES)}


class CounterSink(Protocol):
    """Where the data plane adds its figures (:class:`Counters` or :class:`SharedCounters`)."""

    def add(self, name: str, value: int = 1) -> None: ...

    def set(self, name: str, value: int) -> None: ...

    def snapshot(self) -> Dict[str, int]: ...


class Counters:
    """In-process counters (thread-safe); unknown names are refused."""

    def __init__(self) -> None:
        self._values = np.zeros(len(ALL_NAMES), np.int64)
        self._lock = threading.Lock()

    def add(self, name: str, value: int = 1) -> None:
        i = _INDEX[name]
        with self._lock:
            self._values[i] += int(value)

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[_INDEX[name]] = int(value)

    def get(self, name: str) -> int:
        return int(self._values[_INDEX[name]])

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return {n: int(v) for n, v in zip(ALL_NAMES, self._values.tolist())}


class SharedCounters(Counters):
    """Counters in a shared-memory file (``xavier-<pid>-<hex>``, swept like the storage's
    files when its owner died): :meth:`create` in the writing process, :meth:`open` in a
    reader of the same host.  Aligned int64 words: a reader never sees a torn value."""

    def __init__(self, shm: ShmWords) -> None:
        self.path = shm.path
        self._shm = shm
        self._values = shm.words
        self._lock = threading.Lock()

    @classmethod
    def create(cls, directory: Optional[str] = None) -> SharedCounters:
        return cls(ShmWords.create(len(ALL_NAMES), directory))

    @classmethod
    def open(cls, path: str) -> SharedCounters:
        return cls(ShmWords.open(path, len(ALL_NAMES)))

    @classmethod
    def open_checked(cls, path: str) -> SharedCounters:
        """:meth:`open` for a path another process named (a worker registering with its
        rank's actor): only a regular Xavier file of the counters' size in
        :func:`~.shm_words.shm_dir`, so that a caller cannot have the actor map and write
        any file it can reach (a symlink is refused, and the file checked is the one
        opened).  Anything else is refused, naming ``counters_path``."""
        size = 8 * len(ALL_NAMES)
        why = ("not in " + shm_dir() if os.path.realpath(os.path.dirname(os.path.abspath(path)))
               != os.path.realpath(shm_dir()) else "not a Xavier file name"
               if DATA_NAME.match(os.path.basename(path)) is None else "")

        def check(st: os.stat_result) -> None:
            bad = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"{st.st_size} bytes, expected {size}" if st.st_size != size else "")
            if bad:
                raise ValueError(f"counters_path: {path!r} refused ({bad})")

        if why:
            raise ValueError(f"counters_path: {path!r} refused ({why})")
        try:
            return cls(ShmWords.open(path, len(ALL_NAMES), check))
        except OSError as exc:  # missing, a symlink (ELOOP), not ours
            raise ValueError(f"counters_path: {path!r} refused ({exc.strerror or exc})"
                             ) from None

    def close(self) -> None:
        """Unmap (and, in the creating process, remove the file).  Idempotent."""
        self._values = np.zeros(len(ALL_NAMES), np.int64)
        self._shm.close()


def sum_snapshots(*snapshots: Mapping[str, int]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for snap in snapshots:
        for k, v in snap.items():
            out[k] = out.get(k, 0) + int(v)
    return out


@dataclass
class TransferCounters:
    """Monotonic counters of one rank's load engine (a view of a :class:`CounterSink`).

    * ``logical_requests``: requests carried by load calls (a request with
      loads counts once per call that carries it);
    * ``batch_calls``: ``load_gpu_requests_v1`` calls that were executed;
    * ``transfers``: slab-bounded copies issued;
    * ``fused_transfers``: of those, copies done by the fused Triton kernel;
    * ``useful_bytes``: bytes of source blocks read (into a slab, or straight to the
      destination by the fused kernel);
    * ``padded_bytes``: slab capacity of those transfers left unfilled
      (bytes a fixed-shape wire transfer would carry in vain);
    * ``blocks_written``: destination blocks written (one read may feed several);
    * ``load_failures``: calls whose copies failed after they started;
    * ``rejected_batches``: calls rejected before any copy (conflicts, bad input);
    * ``lease_release_failures``: the scheduler half's directory calls releasing leases that
      failed (each is tried again, a few times);
    * ``reads_validated``: source rows checked after their copy (``doc/validated-reads.md``);
    * ``validation_failures``: of those, rows whose slot no longer held the block (their
      destinations were reported failed: vLLM recomputes them).
    """

    logical_requests: int = 0
    batch_calls: int = 0
    transfers: int = 0
    fused_transfers: int = 0
    useful_bytes: int = 0
    padded_bytes: int = 0
    blocks_written: int = 0
    load_failures: int = 0
    rejected_batches: int = 0
    lease_release_failures: int = 0
    reads_validated: int = 0
    validation_failures: int = 0

    @classmethod
    def of(cls, sink: CounterSink) -> TransferCounters:
        snap = sink.snapshot()
        return cls(**{f.name: snap.get(f.name, 0) for f in fields(cls)})

    def snapshot(self) -> Dict[str, int]:
        return asdict(self)


_HELP = {
    "steps_held_over_50ms": "worker steps Xavier's connector held longer than 50 ms",
    "step_hold_max_us": "longest time Xavier's connector held one step (microseconds)",
    "hit_blocks": "KV blocks found on other replicas and loaded instead of recomputed",
    "useful_bytes": "bytes of KV blocks read by loads",
    "blocks_written": "KV blocks written into this replica's cache by loads",
    "export_exported": "KV blocks this replica stored for its peers",
    "load_failures": "loads whose copies failed (their blocks were recomputed)",
}


#: Xavier's series in Xinference's metrics (Xinference names its own ``xinference:...``)
XINFERENCE_METRIC_PREFIX = "xinference:xavier_"


def prometheus_series(counters: Mapping[str, int], prefix: str = "xavier_"
                      ) -> List[Tuple[str, str, str, int]]:
    """``(metric, kind, help, value)`` per counter of a snapshot: ``*_total`` counters,
    gauges (the levels of :data:`GAUGE_NAMES`) by their name."""
    series = []
    for name, value in counters.items():
        gauge = name in GAUGE_NAMES
        metric = f"{prefix}{name}" if gauge else f"{prefix}{name}_total"
        series.append((metric, "gauge" if gauge else "counter",
                       f"Xavier {_HELP.get(name, name.replace('_', ' '))}", int(value)))
    return series


def prometheus_text(counters: Mapping[str, int], labels: Mapping[str, str],
                    prefix: str = "xavier_") -> str:
    """Prometheus text exposition of a counter snapshot (see :func:`prometheus_series`)."""
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines = []
    for metric, kind, help_text, value in prometheus_series(counters, prefix):
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric}{{{label}}} {value}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def elapsed_us(add: Callable[[int], None],
               add_cpu: Optional[Callable[[int], None]] = None) -> Iterator[None]:
    """Time the block (wall clock) and pass its microseconds to ``add``, also when it
    raises: the time counters (``load_launch_us``, ...) are written so.  ``add_cpu``: also
    the calling thread's CPU time of it (the rest of the wall time was waiting)."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        add(int(1e6 * (time.perf_counter() - t0)))
        if add_cpu is not None:
            add_cpu(int(1e6 * (time.thread_time() - cpu0)))


def activity_line(rank: int, now: Mapping[str, int], before: Mapping[str, int]
                  ) -> Optional[str]:
    """One log line of what rank ``rank`` did since ``before`` (like vLLM's prefix-cache hit
    rate line); ``None`` when it looked nothing up, loaded nothing and exported nothing."""
    def d(name: str) -> int:
        return int(now.get(name, 0)) - int(before.get(name, 0))

    queried, hits = d("queried_blocks"), d("hit_blocks")
    if not (queried or d("batch_calls") or d("export_calls") or d("load_failures")):
        return None
    rate = f"{100.0 * hits / queried:.1f} %" if queried else "-"
    tiers = []
    for tier in ("gpu", "cpu"):
        used = int(now.get(f"storage_{tier}_used_blocks", 0))
        free = int(now.get(f"storage_{tier}_free_blocks", 0))
        if used or free:
            tiers.append(f"{tier.upper()} {used}/{used + free}")
    return (f"xavier rank {rank}: external hit rate {rate} ({hits} of {queried} blocks asked, "
            f"{d('requests_with_hits')} requests, {d('hit_tokens')} tokens); loaded "
            f"{d('blocks_written')} blocks in {d('batch_calls')} calls, {d('load_failures')} "
            f"failed, {d('rows_unreachable')} blocks unreachable (recomputed); exported "
            f"{d('export_exported')} blocks, {d('export_skipped_no_slot')} skipped (no free "
            f"slot); storage blocks used {', '.join(tiers) or '-'}")
