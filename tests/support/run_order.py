"""The order of the test run that lets shared parts be shared (#32), in one place for
``tests/conftest.py`` and for the test of it (``tests/test_run_order.py``); imports nothing
heavy.

* first every test that starts no engine (quick feedback);
* then each shared part's users, one part after the other (the part lives only that long:
  ``support/worlds.py``), those that break it last;
* then the tests that start engines or servers of their own;
* within each, the order of collection.

Users of a shared part and of ``engine_process`` get the ``engine`` marker, and every engine
test the pytest-xdist group ``engines``: with ``--dist loadgroup`` (``scripts/test.sh``) one
worker runs them all, one after the other in this order, while the other runs the rest.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest

#: the pytest-xdist group of every engine test
ENGINE_GROUP = "engines"


def order_for_sharing(items: List[pytest.Item], shared_fixtures: Sequence[str]) -> None:
    """Reorder ``items`` in place (see the module's docstring) and mark the engine tests."""

    def key(entry: Tuple[int, pytest.Item]) -> Tuple[int, int, int]:
        index, item = entry
        for rank, fixture in enumerate(shared_fixtures):
            if fixture in item.fixturenames:
                item.add_marker(pytest.mark.engine)
                return (1 + rank, int(item.get_closest_marker("breaks_world") is not None),
                        index)
        if "engine_process" in item.fixturenames:
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("engine") is not None:
            return (1 + len(shared_fixtures), 0, index)
        return (0, 0, index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    for item in items:
        if item.get_closest_marker("engine") is not None:
            item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))


def ungrouped_engine_tests(items: Sequence[pytest.Item]) -> List[str]:
    """The engine tests whose node id lacks the group pytest-xdist adds with ``--dist
    loadgroup`` (``…@engines``): they would be spread over the workers."""
    return [item.nodeid for item in items
            if item.get_closest_marker("engine") is not None
            and not item.nodeid.endswith("@" + ENGINE_GROUP)]
