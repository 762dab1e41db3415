"""Every cross-reference in the package's docstrings and comments names something that exists
(issue #38: references to modules that moved between layers misled readers).

A reference is a Sphinx role (``:class:``, ``:mod:``, ``:func:``, ``:meth:``, ``:attr:``,
``:data:``, ``:exc:``, ``:obj:``) and resolves as a reader would follow it: ``~`` only
shortens the display; a target with leading dots is a relative import path from the module
(``..planning.block_names.block_name``), and a ``.Name`` that is no module is a name defined
anywhere in the package; a bare target is a name of the module, of one of its classes
(methods, fields, attributes set on ``self``), a builtin, or an absolute import path.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import pathlib
import re
import types
from typing import Dict, List, Optional

PKG_DIR = pathlib.Path(__file__).resolve().parents[1] / "xinference/model/llm/vllm/xavier"
PKG = "xinference.model.llm.vllm.xavier"
ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):`([^`]+)`")
SELF_ATTR = re.compile(r"self\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=")


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG_DIR).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PKG] + parts)


def _walk(obj: object, parts: List[str], instance_attrs: frozenset = frozenset()) -> bool:
    for part in parts:
        fields = getattr(obj, "__dataclass_fields__", None) or {}
        annotations = getattr(obj, "__annotations__", None) or {}
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif (part in fields or part in annotations or part in instance_attrs
              or part in _set_on_self(obj)):
            obj = None  # a field or instance attribute: nothing further to walk
        else:
            return False
    return True


def _set_on_self(obj: object) -> frozenset:
    """The attributes a class sets on ``self`` in its source."""
    try:
        return frozenset(SELF_ATTR.findall(inspect.getsource(obj)))  # type: ignore[arg-type]
    except (TypeError, OSError):
        return frozenset()


def _import_path(full: str) -> bool:
    parts = full.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _walk(module, parts[i:])
    return False


_PACKAGE_NAMES: Dict[str, object] = {}


def package_names() -> Dict[str, object]:
    """Every name a module of the package defines (classes, functions, constants)."""
    if not _PACKAGE_NAMES:
        for path in sorted(PKG_DIR.rglob("*.py")):
            module = importlib.import_module(module_name(path))
            for name, value in vars(module).items():
                if (not isinstance(value, types.ModuleType)
                        and getattr(value, "__module__", module.__name__) == module.__name__):
                    _PACKAGE_NAMES.setdefault(name, value)
    return _PACKAGE_NAMES


def resolves(target: str, module: types.ModuleType, is_package: bool,
             source: str = "") -> bool:
    """Whether ``target`` (a role's text) names something from ``module``'s point of view."""
    target = "".join(target.split()).lstrip("~")
    if "<" in target:  # "text <target>"
        target = target[target.index("<") + 1:target.rindex(">")]
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        base = module.__name__.split(".")[:None if is_package else -1]
        base = base[:len(base) - (dots - 1)]
        if _import_path(".".join(base + [target.lstrip(".")])):
            return True
        if dots > 1:
            return False
        first, *rest = target[1:].split(".")
        return first in package_names() and _walk(package_names()[first], rest)
    parts = target.split(".")
    instance_attrs = frozenset(SELF_ATTR.findall(source))
    owners = [module, builtins] + [v for v in vars(module).values()
                                   if inspect.isclass(v) and v.__module__ == module.__name__]
    return (any(_walk(owner, parts, instance_attrs) for owner in owners)
            or _import_path(target))


def unresolved(source: str, module: types.ModuleType, is_package: bool,
               where: Optional[str] = None) -> List[str]:
    out = []
    for match in ROLE.finditer(source):
        if not resolves(match.group(1), module, is_package, source):
            line = source[:match.start()].count("\n") + 1
            out.append(f"{where or module.__name__}:{line}: {' '.join(match.group(0).split())}")
    return out


def test_every_cross_reference_in_the_package_resolves():
    broken = []
    for path in sorted(PKG_DIR.rglob("*.py")):
        module = importlib.import_module(module_name(path))
        broken += unresolved(path.read_text(), module, path.name == "__init__.py",
                             str(path.relative_to(PKG_DIR)))
    assert not broken, "references to nothing:\n" + "\n".join(broken)


def test_a_reference_to_a_moved_module_is_caught():
    """The control: references as they read before the layers (a module named at the root
    that now lives in a layer folder, a method no class has) are reported; the same names
    at their places resolve."""
    module = importlib.import_module(f"{PKG}.transfer")
    source = (":mod:`.worker_plane` :class:`~.block_directory.BlockDirectory` :meth:`nope`\n"
              ":mod:`.vllm_side.worker_plane` :class:`~.planning.block_directory.BlockDirectory`"
              " :meth:`TransferActor.fetch_blocks` :class:`.SlotGenerations`")
    assert [r.split(": ", 1)[1] for r in unresolved(source, module, False)] == [
        ":mod:`.worker_plane`", ":class:`~.block_directory.BlockDirectory`", ":meth:`nope`"]
