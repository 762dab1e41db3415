"""The run's order (``support/run_order.py``) under the real pytest and pytest-xdist, as
``scripts/test.sh`` runs them: a small suite of stand-in tests (the fixtures' names are the
shared parts', nothing starts) in a pytest of its own, with two workers and without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = textwrap.dedent('''
    import json, os, sys
    import pytest
    sys.path.insert(0, {root!r})
    from tests.support import run_order

    SHARED = ("world_a", "world_b")

    @pytest.fixture
    def world_a(): return "a"

    @pytest.fixture
    def world_b(): return "b"

    @pytest.fixture
    def engine_process(): return "own engine"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(config, items):
        run_order.order_for_sharing(items, SHARED)

    def pytest_collection_finish(session):
        if hasattr(session.config, "workerinput") and session.config.getvalue("loadgroup"):
            lost = run_order.ungrouped_engine_tests(session.items)
            if lost:
                raise pytest.UsageError("not grouped: " + lost[0])

    def pytest_runtest_teardown(item, nextitem):
        with open(os.environ["RUN_LOG"], "a") as log:
            log.write(json.dumps([os.environ.get("PYTEST_XDIST_WORKER", "-"),
                                  item.name, nextitem.name if nextitem else None]) + "\\n")
''')

TESTS = textwrap.dedent('''
    import pytest

    def test_plain_1(): pass
    def test_b_1(world_b): pass
    def test_own(engine_process): pass
    def test_a_1(world_a): pass
    @pytest.mark.breaks_world
    def test_a_breaks(world_a): pass
    def test_a_2(world_a): pass
    def test_plain_2(): pass
    def test_b_2(world_b): pass
    @pytest.mark.engine
    def test_marked(): pass
    @pytest.mark.parametrize("i", range(6))
    def test_plain_many(i): pass
''')

#: the engine tests in the order the run must keep: world_a's users (the breaking one last),
#: world_b's, then those with engines of their own (collection order)
ENGINE_ORDER = ["test_a_1", "test_a_2", "test_a_breaks", "test_b_1", "test_b_2", "test_own",
                "test_marked"]


def run(tmp_path: Path, *args: str) -> List[List[str]]:
    (tmp_path / "conftest.py").write_text(CONFTEST.format(root=str(ROOT)))
    (tmp_path / "test_stand_ins.py").write_text(TESTS)
    log = tmp_path / "run.log"
    env = {**os.environ, "RUN_LOG": str(log)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-c", os.devnull, "--rootdir", str(tmp_path), *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_without_workers_the_engine_tests_follow_the_others_each_part_in_one_stretch(
        tmp_path: Path) -> None:
    ran = [name for _, name, _ in run(tmp_path)]
    plain = [n for n in ran if n.startswith("test_plain")]
    assert ran == plain + ENGINE_ORDER and len(plain) == 8


def test_with_two_workers_one_runs_every_engine_test_in_order_each_next_item_the_next(
        tmp_path: Path) -> None:
    """What ``worlds.close_unneeded`` relies on: on the worker running the engine tests,
    each one's ``nextitem`` is the next engine test (a world closes after its last user)."""
    rows = run(tmp_path, "-n", "2", "--dist", "loadgroup")
    engine = [(worker, name, nxt) for worker, name, nxt in rows if name in ENGINE_ORDER]
    assert len({worker for worker, _, _ in engine}) == 1, engine
    assert [name for _, name, _ in engine] == ENGINE_ORDER
    nexts: Dict[str, str] = {name: nxt for _, name, nxt in engine}
    for this, after in zip(ENGINE_ORDER, ENGINE_ORDER[1:]):
        assert nexts[this] == after
    assert len(rows) == 15
