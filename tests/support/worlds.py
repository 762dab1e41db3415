"""Real engine worlds shared by every test that can use them, across test files (#32).

A *world* is a pair of real vLLM replicas with Xavier (each in its own xoscar sub pool, its
engine core and worker further processes, the block directory in the test's pool: see
``xavier_replicas.py``) of one configuration.  Starting one costs three spawned processes
per replica, each importing torch and vLLM (1-2 minutes on the 2-core machine), so every
test of a configuration uses the same one:

* one world per configuration (:data:`SPECS`), started by the first test that asks for its
  fixture (``qwen_pair``, ``nixl_pair``, ``hybrid_pair``, ``tp_pair``, ``mla_pair`` in
  ``tests/conftest.py``) and closed right after the last test of the run that uses it (the
  run is ordered so that a world's users run one after the other: ``conftest.py``);
* before every test, :meth:`World.reset`: every replica's Xavier storage emptied and its
  blocks gone from the directory, vLLM's local prefix caches reset, the hooks' records of
  recent loads and exports cleared, and checked (no block listed, no lease held, nothing
  stored): a test starts from a world that knows no prefix, whatever ran before;
* a test that damages its world (kills a replica, restarts the directory) carries the
  ``breaks_world`` marker and says so with :meth:`World.mark_broken`; such tests run last
  among the world's users, in the order of collection, each one accepting what the ones
  before it left (as when they shared a module's world); any other later user (a run with
  ``-k``, say) gets a new world.

The same registry keeps other expensive shared parts (one ``xinference-local`` server for
the REST, CLI and web-UI tests): :func:`shared`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from . import run_table
from .engines import EngineOptions
from .loop_thread import LoopThread
from .pools import gpus_from_env
from .xavier_replicas import Replicas

#: "cuda" on the GPU machine (``scripts/gpu-dataplane.sh``): replicas on the GPU, GPU tiers
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
#: with DEVICE "cuda": e.g. "0,1" puts each replica on its own GPU (CUDA IPC across GPUs)
GPUS = gpus_from_env()
#: vLLM's ``kv_cache_dtype`` for the Qwen2 pair, e.g. "fp8" on the H200 (issue #18); vLLM's
#: own default ("auto": the model's dtype) when unset
KV_CACHE_DTYPE = os.environ.get("XAVIER_TEST_KV_CACHE_DTYPE", "")
#: ``XAVIER_TEST_EAGER=1``: the GPU worlds without CUDA graphs (vLLM's default is with)
EAGER = os.environ.get("XAVIER_TEST_EAGER") == "1"


def assert_cuda_graphs_unless_eager(settings: Dict[str, Any]) -> None:
    """On the GPU a world runs as vLLM's defaults do: async scheduling and CUDA graphs (but
    with ``XAVIER_TEST_EAGER=1``); ``settings`` as a replica's ``engine_settings`` says."""
    if DEVICE != "cuda":
        return
    assert settings["async_scheduling"] is True, settings
    if not EAGER:
        assert settings["enforce_eager"] is False, settings
        assert "NONE" not in settings["cudagraph_mode"], settings


@dataclass(frozen=True)
class WorldSpec:
    """One configuration: which tiny model (the conftest fixture building it) and the
    arguments of :func:`~.xavier_replicas.xavier_replicas`."""

    name: str
    model_fixture: str
    replicas_kwargs: Callable[[str], Dict[str, Any]] = field(compare=False)


def _qwen_pair(model_dir: str) -> Dict[str, Any]:
    if DEVICE == "cuda":  # vLLM's defaults: CUDA graphs, async scheduling, its model runner
        opts = EngineOptions(model=model_dir, extra={
            "attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.25,
            "enforce_eager": EAGER,
            **({"kv_cache_dtype": KV_CACHE_DTYPE} if KV_CACHE_DTYPE else {})})
        return dict(n=2, gpu_budget="256MiB", cpu_budget="64MiB", engine=opts,
                    sequential=GPUS is None, gpus=GPUS)
    return dict(n=2)


def _nixl_pair(model_dir: str) -> Dict[str, Any]:
    return dict(n=2, transport="nixl")


def _hybrid_pair(model_dir: str) -> Dict[str, Any]:
    if DEVICE == "cuda":  # vLLM's defaults (CUDA graphs, async scheduling), as in the e2e
        opts = EngineOptions(model=model_dir, extra={
            "attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.25,
            "enforce_eager": EAGER})
        return dict(n=2, gpu_budget="256MiB", cpu_budget="64MiB", engine=opts,
                    sequential=True)
    return dict(n=2)


#: the tensor-parallel degree of the ``tp_pair`` world
TP = 2


def _tp_pair(model_dir: str) -> Dict[str, Any]:
    extra: Dict[str, Any] = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}
    if DEVICE == "cuda":  # vLLM's defaults otherwise (CUDA graphs, async scheduling)
        extra.update({"attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.25,
                      "enforce_eager": False})
        return dict(n=2, gpu_budget="256MiB", cpu_budget="64MiB",
                    engine=EngineOptions(model=model_dir, extra=extra), sequential=True,
                    gpus=["0,1", "0,1"])
    # vLLM's CPU build needs each worker's OpenMP threads bound by hand on 2 cores
    return dict(n=2, engine=EngineOptions(model=model_dir, extra=extra),
                extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, sequential=True)


def _mla_pair(model_dir: str) -> Dict[str, Any]:
    opts = EngineOptions(model=model_dir, extra={
        "attention_backend": "TRITON_MLA", "gpu_memory_utilization": 0.25,
        "enforce_eager": EAGER})
    return dict(n=2, gpu_budget="256MiB", cpu_budget="64MiB", engine=opts, sequential=True)


#: vLLM blocks of each replica of the ``churn_pair`` world: a few prompts reuse them all
CHURN_BLOCKS = 72


def _churn_pair(model_dir: str) -> Dict[str, Any]:
    """A pair whose vLLM caches hold a handful of prompts (``num_gpu_blocks_override``), so
    that a test can make a source hand out again the blocks it published (#33); those of
    them shown to be shared are saved into Xavier's tier (``xavier_save_victims``' default)."""
    extra: Dict[str, Any] = {"num_gpu_blocks_override": CHURN_BLOCKS}
    if DEVICE == "cuda":
        extra.update({"attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.25,
                      "enforce_eager": False})
        return dict(n=2, gpu_budget="256MiB", cpu_budget="64MiB", sequential=True,
                    engine=EngineOptions(model=model_dir, max_model_len=1024, extra=extra))
    return dict(n=2, engine=EngineOptions(model=model_dir, max_model_len=1024, extra=extra))


#: fixture name -> the world it gives (``tests/conftest.py`` defines the fixtures)
SPECS: Dict[str, WorldSpec] = {
    "qwen_pair": WorldSpec("qwen-pair", "tiny_model_dir", _qwen_pair),
    "nixl_pair": WorldSpec("nixl-pair", "tiny_model_dir", _nixl_pair),
    "hybrid_pair": WorldSpec("hybrid-pair", "tiny_hybrid_model_dir", _hybrid_pair),
    "tp_pair": WorldSpec("tp-pair", "tiny_model_dir", _tp_pair),
    "mla_pair": WorldSpec("mla-pair", "tiny_mla_model_dir", _mla_pair),
    "churn_pair": WorldSpec("churn-pair", "tiny_model_dir", _churn_pair),
}


@dataclass
class ResetReport:
    """What :meth:`World.reset` found and left: blocks it removed from the replicas'
    storages, and the directory's figures afterwards."""

    cleared_blocks: int
    directory_blocks: int
    outstanding_leases: int


class World:
    """A started world: ``lt`` (the loop its actors are driven from) and ``replicas``."""

    def __init__(self, spec: WorldSpec, model_dir: str) -> None:
        from .xavier_replicas import replicas_in_loop_thread

        self.spec = spec
        t0 = time.monotonic()
        self._gen: Iterator[Tuple[LoopThread, Replicas]] = replicas_in_loop_thread(
            model_dir, **spec.replicas_kwargs(model_dir))
        self.lt, self.replicas = next(self._gen)
        self.start_s = time.monotonic() - t0
        self.tests = 0
        self.broken: Optional[str] = None
        self._baseline: List[Dict[str, int]] = []
        run_table.note_shared_world(spec.name)

    @property
    def pair(self) -> Tuple[LoopThread, Replicas]:
        """``(loop thread, replicas)``: what the suites' ``world`` fixtures hand out."""
        return self.lt, self.replicas

    def reset(self) -> ResetReport:
        """Forget everything the previous test left (see the module) and check it."""
        lt = self.lt
        cleared = 0
        for rep in self.replicas.replicas:
            lt.run(rep.hook_all("flush"))
        for rep in self.replicas.replicas:
            per_worker = lt.run(rep.hook_all("clear_storage"))
            cleared += sum(w["cleared"] for w in per_worker)
            if any(w["left"] for w in per_worker):
                raise AssertionError(f"world {self.spec.name}: blocks still leased at the "
                                     f"reset ({per_worker}): a lease was not released")
        for rep in self.replicas.replicas:
            if not lt.run(rep.reset_prefix_cache()):
                raise AssertionError(f"world {self.spec.name}: vLLM refused to reset its "
                                     "prefix cache (a request of the previous test still runs)")
            lt.run(rep.hook_all("reset_recent"))
        stats = lt.run(self.replicas.tracker.stats())
        report = ResetReport(cleared, int(stats["blocks"]), int(stats["outstanding_leases"]))
        if report.directory_blocks or report.outstanding_leases:
            raise AssertionError(f"world {self.spec.name}: after the reset the directory "
                                 f"still lists {stats['blocks']} blocks and "
                                 f"{stats['outstanding_leases']} leases")
        self._baseline = [lt.run(rep.counters()) for rep in self.replicas.replicas]
        self.tests += 1
        return report

    def since_reset(self, index: int) -> Dict[str, int]:
        """Replica ``index``'s counters that changed since the last :meth:`reset`."""
        now = self.lt.run(self.replicas.replicas[index].counters())
        base = self._baseline[index] if index < len(self._baseline) else {}
        return {k: v - base.get(k, 0) for k, v in now.items() if v != base.get(k, 0)}

    def mark_broken(self, why: str) -> None:
        """This world must not serve another test (a replica killed, the directory
        restarted): it is closed after the current test."""
        self.broken = why

    def close(self) -> None:
        try:
            next(self._gen)
        except StopIteration:
            pass


#: started shared parts by fixture name: worlds, and the others :func:`shared` keeps
_LIVE: Dict[str, Any] = {}
_CLOSERS: Dict[str, Callable[[Any], None]] = {}


def use_world(fixture: str, model_dir: str, breaking: bool = False) -> World:
    """The world of ``fixture`` (started on first use, again after it broke unless the test
    itself is a ``breaking`` one), reset."""
    world = _LIVE.get(fixture)
    if world is not None and world.broken and not breaking:
        close(fixture)
        world = None
    if world is None:
        world = World(SPECS[fixture], model_dir)
        _LIVE[fixture] = world
        _CLOSERS[fixture] = World.close
    world.reset()
    return world


def shared(fixture: str, start: Callable[[], Any], stop: Callable[[Any], None]) -> Any:
    """A shared part other than a world (e.g. an ``xinference-local`` server) under
    ``fixture``'s name: started on first use, stopped after its last user."""
    if fixture not in _LIVE:
        _LIVE[fixture] = start()
        _CLOSERS[fixture] = stop
        run_table.note_shared_world(fixture)
    return _LIVE[fixture]


def close(fixture: str) -> None:
    part = _LIVE.pop(fixture, None)
    stop = _CLOSERS.pop(fixture, None)
    if part is not None and stop is not None:
        stop(part)


def close_unneeded(next_fixtures: Sequence[str], next_breaks: bool = False) -> List[str]:
    """Close every shared part the next test does not use (none: the run ends), and every
    world marked broken unless the next test is a breaking one too; returns their fixture
    names."""
    closed = []
    for fixture in list(_LIVE):
        part = _LIVE[fixture]
        if fixture not in next_fixtures or (getattr(part, "broken", None) and not next_breaks):
            close(fixture)
            closed.append(fixture)
    return closed


#: the fixtures that start shared parts, in the order their users run (``conftest.py``)
SHARED_FIXTURES = tuple(SPECS) + ("xinference_server",)
