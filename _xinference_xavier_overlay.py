"""Import overlay: serve this project's Xavier package as ``xinference.model.llm.vllm.xavier``.

Installed with a ``.pth`` line, so every Python process of the environment
(supervisor, worker subpools, model actors, vLLM's spawned engine-core and
worker processes) runs :func:`install` at start-up.  :func:`install` puts
:class:`XavierOverlayFinder` first on ``sys.meta_path``; the finder claims
exactly one module name, :data:`TARGET`, and answers with a spec whose
``__path__`` is this project's package directory, so every submodule follows
it.  Upstream Xinference's files are never read, written or moved: uninstall
this project and upstream's package is served again.

Set ``XINFERENCE_XAVIER_OVERLAY=0`` to switch the overlay off for a process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Sequence

#: the module name the overlay claims
TARGET = "xinference.model.llm.vllm.xavier"
#: the top-level name under which this project's package files are installed
FORK_PACKAGE = "_xinference_xavier_fork"
ENV_SWITCH = "XINFERENCE_XAVIER_OVERLAY"


class XavierOverlayFinder:
    """Meta-path finder that maps :data:`TARGET` onto :data:`FORK_PACKAGE`'s directory."""

    @classmethod
    def fork_location(cls) -> Optional[str]:
        """Directory of the installed fork package (regular or editable install)."""
        spec = importlib.util.find_spec(FORK_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            return None
        return list(spec.submodule_search_locations)[0]

    @classmethod
    def find_spec(cls, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != TARGET:
            return None
        location = cls.fork_location()
        if location is None:
            return None
        init = os.path.join(location, "__init__.py")
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[location])


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (idempotent). Returns whether it is active."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not any(f is XavierOverlayFinder for f in sys.meta_path):
        sys.meta_path.insert(0, XavierOverlayFinder)  # type: ignore[arg-type]
    return True


def is_active() -> bool:
    return any(f is XavierOverlayFinder for f in sys.meta_path)
