"""Shared fixtures: the tiny local models, real vLLM engines, real xoscar pools; the shared
engine worlds and ``xinference-local`` server (``support/worlds.py``), the order of the run
that lets them be shared, and the table of what each test file cost (``support/run_table.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, List, Optional

import pytest

from .support import run_order, run_table, worlds
from .support.engines import EngineOptions, EngineProcess
from .support.tiny_model import (
    TinyDeepseekV2,
    TinyGemma3,
    TinyQwen2,
    build_tiny_deepseek_v2,
    build_tiny_gemma3,
    build_tiny_qwen2,
)
from .support.xinference_server import Server

#: every replica the tests start (engine worlds, xinference-local, simulated hosts: they
#: inherit this process's environment) loads each hit it is offered: the tests check what a
#: load does (tokens, bytes, counters, leases), on a tiny model whose recompute costs about
#: what a load waits, so that the default ``cost`` policy would decline some hits by timing
#: alone.  The cost model itself still measures there (its estimates and
#: ``hits_not_paying`` are checked in test_connector_e2e.py); its decisions are tested in
#: test_load_cost.py and test_scheduler_side.py.
os.environ.setdefault("XAVIER_LOAD_POLICY", "always")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen2 model, built once per test run (or taken from XAVIER_TINY_MODEL_DIR,
    where it is built once and kept)."""
    keep = os.environ.get("XAVIER_TINY_MODEL_DIR")
    out = keep or str(tmp_path_factory.mktemp("tiny-qwen2"))
    return build_tiny_qwen2(out, TinyQwen2())


@pytest.fixture(scope="session")
def tiny_hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Gemma-3-shaped model (sliding-window and full-attention layers alternate),
    built once per test run (or kept in XAVIER_TINY_HYBRID_MODEL_DIR)."""
    keep = os.environ.get("XAVIER_TINY_HYBRID_MODEL_DIR")
    out = keep or str(tmp_path_factory.mktemp("tiny-gemma3"))
    return build_tiny_gemma3(out, TinyGemma3())


@pytest.fixture(scope="session")
def tiny_mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny DeepSeek-V2-shaped model (multi-head latent attention), built once per test
    run (or kept in XAVIER_TINY_MLA_MODEL_DIR)."""
    keep = os.environ.get("XAVIER_TINY_MLA_MODEL_DIR")
    out = keep or str(tmp_path_factory.mktemp("tiny-deepseek-v2"))
    return build_tiny_deepseek_v2(out, TinyDeepseekV2())


@pytest.fixture(scope="module")
def engine_process(tiny_model_dir: str) -> Iterator[EngineProcess]:
    """A real vLLM V1 CPU engine in a child process (its own engine-core process too), one
    per test module."""
    eng = EngineProcess(EngineOptions(model=tiny_model_dir))
    try:
        yield eng
    finally:
        eng.close()


# ------------------------------------------------------------------ shared engine worlds
# Each is started by its first user and closed after its last (see support/worlds.py);
# every test gets it reset.
def _breaks(request: pytest.FixtureRequest) -> bool:
    return request.node.get_closest_marker("breaks_world") is not None


@pytest.fixture
def qwen_pair(request: pytest.FixtureRequest, tiny_model_dir: str) -> worlds.World:
    """Two replicas of the tiny Qwen2 with Xavier, the default launch."""
    return worlds.use_world("qwen_pair", tiny_model_dir, _breaks(request))


@pytest.fixture
def nixl_pair(request: pytest.FixtureRequest, tiny_model_dir: str) -> worlds.World:
    """Two replicas of the tiny Qwen2 launched with ``vllm_transfer_backend_type: nixl``."""
    return worlds.use_world("nixl_pair", tiny_model_dir, _breaks(request))


@pytest.fixture
def hybrid_pair(request: pytest.FixtureRequest, tiny_hybrid_model_dir: str) -> worlds.World:
    """Two replicas of the tiny Gemma-3 (sliding-window and full attention)."""
    return worlds.use_world("hybrid_pair", tiny_hybrid_model_dir, _breaks(request))


@pytest.fixture
def tp_pair(request: pytest.FixtureRequest, tiny_model_dir: str) -> worlds.World:
    """Two tensor-parallel replicas (two workers each) of the tiny Qwen2."""
    return worlds.use_world("tp_pair", tiny_model_dir, _breaks(request))


@pytest.fixture
def churn_pair(request: pytest.FixtureRequest, tiny_model_dir: str) -> worlds.World:
    """Two replicas of the tiny Qwen2 whose vLLM caches hold only a few prompts."""
    return worlds.use_world("churn_pair", tiny_model_dir, _breaks(request))


@pytest.fixture
def mla_pair(request: pytest.FixtureRequest, tiny_mla_model_dir: str) -> worlds.World:
    """Two replicas of the tiny DeepSeek-V2 (multi-head latent attention; GPU only)."""
    return worlds.use_world("mla_pair", tiny_mla_model_dir, _breaks(request))


@pytest.fixture
def xinference_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One real ``xinference-local`` for the REST, CLI and web-UI tests (started by the
    first, stopped after the last); no model runs when a test gets it."""
    server = worlds.shared(
        "xinference_server", lambda: Server(str(tmp_path_factory.mktemp("xinference-local"))),
        Server.stop)
    server.begin_test()
    return server


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Order the run so that shared parts can be shared, marking the engine tests
    (``support/run_order.py``)."""
    run_order.order_for_sharing(items, worlds.SHARED_FIXTURES)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a pytest-xdist worker with ``--dist loadgroup``: every engine test must carry its
    group in its node id (pytest-xdist adds ``@engines``) or the engine tests are spread
    over the workers, each starting worlds of its own; fail the run at once, saying so."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    lost = run_order.ungrouped_engine_tests(session.items)
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} engine tests (e.g. {lost[0]}): this "
            f"pytest ({pytest.__version__}) and pytest-xdist do not work together; install "
            "the test extras' pinned versions (scripts/setup.sh)")


FAST = os.environ.get("XAVIER_TEST_FAST") == "1"
_STARTS_BEFORE: List[int] = [0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if FAST and _WATCHER:
        _WATCHER[0].scan_now()
        _STARTS_BEFORE[0] = run_table.total_starts()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures were torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
    """After a test: close the shared parts the next test does not use (all of them after
    the last test), and a world the test marked broken.  In the fast loop (``scripts/
    test.sh --fast``): fail a test that started an engine or a server (it lacks the
    ``engine`` marker)."""
    if nextitem is None:
        worlds.close_unneeded([])
    else:
        worlds.close_unneeded(list(nextitem.fixturenames),
                              nextitem.get_closest_marker("breaks_world") is not None)
    if FAST and _WATCHER:
        _WATCHER[0].scan_now()
        started = run_table.total_starts() - _STARTS_BEFORE[0]
        if started:
            pytest.fail(f"the fast loop runs no engine, but this test started {started} "
                        "vLLM engines or Xinference processes: mark it @pytest.mark.engine")


_WATCHER: List[run_table.ProcessWatcher] = []


def _xdist_controller(config: pytest.Config) -> bool:
    """This process hands the tests to pytest-xdist workers (``-n``) and runs none."""
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Count engine and Xinference process starts per test file (``support/run_table.py``);
    under pytest-xdist each worker counts its own and the controller adds them up."""
    if _xdist_controller(session.config):
        return
    watcher = run_table.ProcessWatcher()
    watcher.start()
    _WATCHER.append(watcher)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    run_table.enter_file(item.location[0])
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    run_table.add_time(report.location[0], report.duration, report.when == "teardown")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    worlds.close_unneeded([])  # an interrupted run still stops its engines
    for watcher in _WATCHER:
        watcher.stop()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller prints the table
        from dataclasses import asdict

        from .support import reliability

        workeroutput["xavier_process_counts"] = json.dumps(run_table.process_counts())
        workeroutput["xavier_reliability_rows"] = json.dumps(
            [asdict(row) for row in reliability.ROWS])


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's (the controller's side)
def pytest_testnodedown(node: Any, error: Any) -> None:
    from .support import reliability

    output = getattr(node, "workeroutput", {})
    if output.get("xavier_process_counts"):
        run_table.add_process_counts(json.loads(output["xavier_process_counts"]))
    for row in json.loads(output.get("xavier_reliability_rows") or "[]"):
        reliability.ROWS.append(reliability.Row(**row))


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    """Print the reliability suite's table (faults tried, survived, requests, leaks) and what
    each test file cost (seconds, engine starts, Xinference servers and workers)."""
    from .support import reliability

    lines = reliability.table()
    if lines:
        terminalreporter.section("xavier reliability summary")
        for line in lines:
            terminalreporter.write_line(line)
        reliability.write_json()
    lines = run_table.table()
    if lines:
        terminalreporter.section("xavier test-run cost per file")
        for line in lines:
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"wall clock of the run: {run_table.wall_seconds():.0f} s "
                                    "(a shared world's teardown counts for the last file "
                                    "that ran)")
        run_table.write_json(run_table.wall_seconds())
