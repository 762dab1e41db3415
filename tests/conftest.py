"""Shared fixtures: the tiny local model, real vLLM engines, real xoscar pools."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

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


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    """Print the reliability suite's table (faults tried, survived, requests, leaks)."""
    from .support import reliability

    lines = reliability.table()
    if lines:
        terminalreporter.section("xavier reliability summary")
        for line in lines:
            terminalreporter.write_line(line)
        reliability.write_json()
