"""Shared fixtures: the tiny local model, real vLLM engines, real xoscar pools."""

from __future__ import annotations

import os
from typing import Iterator, List, Optional

import pytest

from .support import run_table
from .support.engines import EngineOptions, EngineProcess
from .support.tiny_model import (
    TinyDeepseekV2,
    TinyGemma3,
    TinyQwen2,
    build_tiny_deepseek_v2,
    build_tiny_gemma3,
    build_tiny_qwen2,
)


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


@pytest.fixture
def engine_process(tiny_model_dir: str) -> Iterator[EngineProcess]:
    """A real vLLM V1 CPU engine in a child process (its own engine-core process too)."""
    eng = EngineProcess(EngineOptions(model=tiny_model_dir))
    try:
        yield eng
    finally:
        eng.close()


_WATCHER: List[run_table.ProcessWatcher] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """Count engine and Xinference process starts per test file (``support/run_table.py``)."""
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
    for watcher in _WATCHER:
        watcher.stop()


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
