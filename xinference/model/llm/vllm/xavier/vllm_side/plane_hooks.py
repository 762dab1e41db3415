"""The test observer a worker's data plane may call (tests only): faults a real engine
cannot make on demand, digests.  A production plane has none: the plane builds one only
when :data:`TEST_HOOKS_ENV` names its class in the engine's environment
(``tests/support/worker_hooks.py``)."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Set, Tuple

from ..planning.load_batch import LoadBatch

if TYPE_CHECKING:  # pragma: no cover
    from .worker_plane import WorkerDataPlane

#: ``module:Class`` of a :class:`PlaneHooks` observer (tests only; unset in production)
TEST_HOOKS_ENV = "XAVIER_TEST_HOOKS"


class PlaneHooks(Protocol):
    """What the plane tells a test observer (faults a real engine cannot make on demand,
    digests).  Production planes have none; see :data:`TEST_HOOKS_ENV`."""

    def before_load(self, batch: LoadBatch) -> None: ...

    def apply_faults(self, batch: LoadBatch, failed: Set[int]) -> Optional[LoadBatch]: ...

    def holding(self) -> bool: ...

    def loaded_failed(self, failed: Set[int]) -> None: ...

    def exported(self, rows: Sequence[Tuple[int, int, int]]) -> None: ...

    def published_in_place(self, rows: Sequence[Tuple[int, int, int, int]]) -> None: ...


def load_test_hooks(plane: WorkerDataPlane) -> Optional[PlaneHooks]:
    """The observer named by :data:`TEST_HOOKS_ENV` (``module:Class``), built for ``plane``;
    ``None`` when unset.  A bad name raises naming the variable (the worker connector then
    turns sharing off on this worker and logs why)."""
    spec = os.environ.get(TEST_HOOKS_ENV, "").strip()
    if not spec:
        return None
    module_name, _, class_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{TEST_HOOKS_ENV}={spec!r}: expected module:Class of an importable "
                         f"hooks class ({exc})") from exc
    hooks: PlaneHooks = factory(plane)
    return hooks
