"""Import overlay: serve this project's Xavier package as ``xinference.model.llm.vllm.xavier``.

Installed with a ``.pth`` line, so every Python process of the environment
(supervisor, worker subpools, model actors, vLLM's spawned engine-core and
worker processes) runs :func:`install` at start-up.  :func:`install` puts
:class:`XavierOverlayFinder` first on ``sys.meta_path``; the finder claims
:data:`TARGET` and every module under it and answers each with the module of
the same path under :data:`FORK_PACKAGE`, the name this project's package is
installed under: ``xinference.model.llm.vllm.xavier.engine`` *is*
``_xinference_xavier_fork.engine`` (one module object, two names in
``sys.modules``, the aliasing setuptools does for ``distutils``).  So a process
that needs only Xavier (vLLM's engine-core and worker processes loading the
connector by :data:`FORK_PACKAGE`'s path, an xoscar sub pool unpickling a
Xavier actor class) does not run upstream's ``xinference/model/__init__.py``,
which imports every model family of Xinference (~8 s of CPU beside vLLM, ~20 s
alone, on the 2-core machine).  Upstream Xinference's files are never read,
written or moved: uninstall this project and upstream's package is served again.

Set ``XINFERENCE_XAVIER_OVERLAY=0`` to switch the overlay off for a process.

Xinference 3.5.0 runs each model in its own virtualenv by default
(``XINFERENCE_ENABLE_VIRTUAL_ENV``); that child venv sees this environment's
site-packages only as a plain path (``_xinference_parent.pth``), so ``.pth``
files here are not processed there.  :func:`install` therefore also watches the
import of ``xinference.core.worker`` and, once it is loaded, wraps
``WorkerActor._create_virtual_env_manager`` so that every child venv it prepares
gets :data:`CHILD_PTH`, a one-line bootstrap that loads this module by its
absolute path and installs the finder with the fork's location.  Only that file
in the child venv is written; upstream's files are not.

Four more upstream modules are wrapped when imported: ``xinference.core.supervisor``
(Xavier's launch options checked before any engine starts; the model's ``xavier_routing``
kept there, with two methods the API's router calls: a model's live replicas and one
replica's model actor), ``xinference.api.restful_api`` (chat and completion requests of a
Xavier model routed by cache and load: ``replica_routing.py``), ``xinference.core.metrics``
(a :class:`XavierMetricsSink` under the name :data:`METRICS_SINK`, so that replicas'
counters reach the worker's metrics endpoint through upstream's own
``WorkerActor.record_metrics``) and ``xinference.deploy.cmdline`` (``xinference launch``
of a Xavier model waits for the whole launch and exits non-zero with the server's message
when it fails, also after its engines started; upstream's CLI exits 0 then).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

#: the module name the overlay claims
TARGET = "xinference.model.llm.vllm.xavier"
#: the top-level name under which this project's package files are installed
FORK_PACKAGE = "_xinference_xavier_fork"
ENV_SWITCH = "XINFERENCE_XAVIER_OVERLAY"
#: the bootstrap file written into Xinference's per-model virtualenvs
CHILD_PTH = "xinference_xavier_overlay.pth"
WORKER_MODULE = "xinference.core.worker"
SUPERVISOR_MODULE = "xinference.core.supervisor"
METRICS_MODULE = "xinference.core.metrics"
CMDLINE_MODULE = "xinference.deploy.cmdline"
API_MODULE = "xinference.api.restful_api"
#: the name Xavier's transfer actors pass to ``WorkerActor.record_metrics``
METRICS_SINK = "xavier_counters"

logger = logging.getLogger("xinference_xavier_overlay")


class XavierOverlayFinder:
    """Meta-path finder: :data:`TARGET` and its submodules are aliases of the modules of
    the same path under :data:`FORK_PACKAGE`; in a child venv it also finds
    :data:`FORK_PACKAGE` itself (at :attr:`fixed_location`)."""

    #: set in a child venv, where the fork package itself is not importable by name
    fixed_location: Optional[str] = None

    @classmethod
    def fork_location(cls) -> Optional[str]:
        """Directory of the installed fork package (regular or editable install)."""
        if cls.fixed_location is not None:
            return cls.fixed_location
        spec = importlib.util.find_spec(FORK_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            return None
        return list(spec.submodule_search_locations)[0]

    @classmethod
    def find_spec(cls, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == FORK_PACKAGE and cls.fixed_location is not None:
            init = os.path.join(cls.fixed_location, "__init__.py")
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[cls.fixed_location])
        if fullname != TARGET and not fullname.startswith(TARGET + "."):
            return None
        if cls.fork_location() is None:
            return None
        real = FORK_PACKAGE + fullname[len(TARGET):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real))


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias: the module object is the one imported under ``real``."""

    def __init__(self, real: str) -> None:
        self.real = real
        self._real_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.real)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module: the real one stays
        module.__spec__ = self._real_spec


def install(location: Optional[str] = None) -> bool:
    """Put the finder first on ``sys.meta_path`` (idempotent). Returns whether it is active.
    ``location``: the fork package's directory (child venvs, see the module docstring)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if location is not None:
        XavierOverlayFinder.fixed_location = location
    if not any(f is XavierOverlayFinder for f in sys.meta_path):
        sys.meta_path.insert(0, XavierOverlayFinder)  # type: ignore[arg-type]
    if not any(f is _WorkerHook for f in sys.meta_path):
        sys.meta_path.insert(1, _WorkerHook)  # type: ignore[arg-type]
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    return True


def child_pth_line() -> str:
    """The bootstrap line for a child venv's ``.pth`` (absolute paths of this install)."""
    here = os.path.abspath(__file__)
    location = XavierOverlayFinder.fork_location()
    return ("import importlib.util as u, sys; s = u.spec_from_file_location("
            f"'_xinference_xavier_overlay', {here!r}); m = u.module_from_spec(s); "
            "sys.modules.setdefault('_xinference_xavier_overlay', m); s.loader.exec_module(m); "
            f"m.install({location!r})\n")


def write_child_pth(lib_path: str) -> Optional[str]:
    """Write :data:`CHILD_PTH` into a child venv's site-packages; returns its path."""
    if XavierOverlayFinder.fork_location() is None or not os.path.isdir(lib_path):
        return None
    path = os.path.join(lib_path, CHILD_PTH)
    line = child_pth_line()
    try:
        with open(path) as f:
            if f.read() == line:
                return path
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, path)
    logger.info("xavier overlay: carried into the model virtualenv %s", lib_path)
    return path


def _patch_worker(module: ModuleType) -> bool:
    """Wrap ``WorkerActor._create_virtual_env_manager`` to bootstrap the overlay in every
    child venv it prepares.  Idempotent; a missing hook (other Xinference) is logged."""
    cls = getattr(module, "WorkerActor", None)
    original = getattr(cls, "__dict__", {}).get("_create_virtual_env_manager")
    if not isinstance(original, classmethod):
        logger.warning("xavier overlay: %s.WorkerActor._create_virtual_env_manager not found; "
                       "per-model virtualenvs will use upstream's xavier package", WORKER_MODULE)
        return False
    func = original.__func__
    if getattr(func, "_xavier_overlay", False):
        return True

    @functools.wraps(func)
    def create(klass: Any, *args: Any, **kwargs: Any) -> Any:
        manager = func(klass, *args, **kwargs)
        if manager is not None:
            try:
                write_child_pth(str(manager.get_lib_path()))
            except Exception as exc:  # the model then runs with upstream's package
                logger.warning("xavier overlay: could not bootstrap the virtualenv: %s", exc)
        return manager

    create._xavier_overlay = True  # type: ignore[attr-defined]
    cls._create_virtual_env_manager = classmethod(create)  # type: ignore[union-attr]
    return True


def _patch_supervisor(module: ModuleType) -> bool:
    """Wrap ``SupervisorActor.launch_builtin_model`` so that Xavier's launch options are
    normalized and checked before upstream reads them (``planning/launch_checks.py``: the
    CLI's ``enable-xavier`` spelling, ``enable_xavier`` as a strict switch, the replica
    count and ``XAVIER_*`` envs), and a Xavier launch first removes the actors an earlier
    termination of the same uid left behind (``block_tracker.drop_leftover_actors``).
    Idempotent; a missing method (other Xinference) is logged and the launch stays
    upstream's."""
    cls = getattr(module, "SupervisorActor", None)
    func = getattr(cls, "__dict__", {}).get("launch_builtin_model")
    if func is None or not inspect.iscoroutinefunction(func):
        logger.warning("xavier overlay: %s.SupervisorActor.launch_builtin_model not found; "
                       "Xavier's launch options are not checked in the supervisor",
                       SUPERVISOR_MODULE)
        return False
    if getattr(func, "_xavier_overlay", False):
        return True
    signature = inspect.signature(func)

    @functools.wraps(func)
    async def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        from xinference.model.llm.vllm.xavier.planning.launch_checks import normalize_launch

        bound = signature.bind(self, *args, **kwargs)
        extra = bound.arguments.get("kwargs", {})
        normalize_launch(extra, bound.arguments.get("replica", 1), bound.arguments.get("envs"))
        # the router's option is the supervisor's own: never passed on to the model
        routing = extra.pop("xavier_routing", None) if extra.get("enable_xavier") else None
        if extra.get("enable_xavier") is True:
            from xinference.model.llm.vllm.xavier.block_tracker import drop_leftover_actors

            uid = bound.arguments.get("model_uid") or bound.arguments.get("model_name")
            if isinstance(uid, str) and uid:
                await drop_leftover_actors(self, uid)
        launched = await func(*bound.args, **bound.kwargs)
        if isinstance(launched, str):
            from xinference.model.llm.vllm.xavier.replica_routing import (
                supervisor_record_routing,
            )

            supervisor_record_routing(self, launched, routing)
        return launched

    launch._xavier_overlay = True  # type: ignore[attr-defined]
    cls.launch_builtin_model = launch  # type: ignore[union-attr]

    async def xavier_route_info(self: Any, model_uid: str, **_rpc: Any) -> Any:
        """``(launch id, live replicas)`` of a model Xavier routes (None: Xinference's
        cycle)."""
        from xinference.model.llm.vllm.xavier.replica_routing import supervisor_route_info

        return await supervisor_route_info(self, module, model_uid)

    async def xavier_replica_model(self: Any, model_uid: str, replica_id: int,
                                   launch: Optional[str] = None, **_rpc: Any) -> Any:
        """The model actor of one replica (the one Xavier's router chose); ``_rpc``:
        Xinference's call metadata (``actor_call`` adds it to correlate the request)."""
        from xinference.model.llm.vllm.xavier.replica_routing import (
            supervisor_replica_model,
        )

        return await supervisor_replica_model(self, module, model_uid, int(replica_id),
                                              launch)

    cls.xavier_route_info = xavier_route_info  # type: ignore[union-attr]
    cls.xavier_replica_model = xavier_replica_model  # type: ignore[union-attr]
    return True


def _patch_api(module: ModuleType) -> bool:
    """Route the chat and completion requests of models launched with Xavier
    (``replica_routing.py``): ``RESTfulAPI.create_chat_completion`` and
    ``create_completion`` wrapped, ``require_model`` of the module's namespace replaced by
    one that returns the chosen replica.  Idempotent; a missing name (other Xinference) is
    logged and requests keep Xinference's round robin."""
    cls = getattr(module, "RESTfulAPI", None)
    original_require = getattr(module, "require_model", None)
    names = ("create_chat_completion", "create_completion")
    if cls is None or original_require is None or any(
            not inspect.iscoroutinefunction(cls.__dict__.get(n)) for n in names):
        logger.warning("xavier overlay: %s has no RESTfulAPI.%s or require_model; requests "
                       "are not routed by cache", API_MODULE, " / ".join(names))
        return False
    if getattr(original_require, "_xavier_overlay", False):
        return True
    from xinference.model.llm.vllm.xavier.replica_routing import API_ROUTING, wrap_handler

    for name in names:
        setattr(cls, name, wrap_handler(cls.__dict__[name]))

    @functools.wraps(original_require)
    async def require_model(get_supervisor_ref: Any, model_uid: str,
                            report_error_event: Any = None) -> Any:
        return await API_ROUTING.require_model(original_require, get_supervisor_ref,
                                               model_uid, report_error_event)

    require_model._xavier_overlay = True  # type: ignore[attr-defined]
    module.require_model = require_model  # type: ignore[attr-defined]
    return True


class XavierMetricsSink:
    """Xavier's counters as series of the worker's metrics endpoint.  Upstream's
    ``record_metrics(name, op, kwargs)`` looks ``name`` up in ``xinference.core.metrics``
    and calls ``op`` on it: each replica's transfer actor sends its counter snapshot with
    ``op="set"`` (and ``"remove"`` when it closes), the path Xinference's model actors use
    for their own series.  Collectors are made on first use, in the process's registry."""

    def __init__(self) -> None:
        self._collectors: dict = {}

    def set(self, labels: dict, values: dict) -> None:
        from aioprometheus import Counter, Gauge

        from xinference.model.llm.vllm.xavier.planning.counters import (
            XINFERENCE_METRIC_PREFIX,
            prometheus_series,
        )

        for metric, kind, help_text, value in prometheus_series(values,
                                                                XINFERENCE_METRIC_PREFIX):
            collector = self._collectors.get(metric)
            if collector is None:
                collector = (Gauge if kind == "gauge" else Counter)(metric, help_text)
                self._collectors[metric] = collector
            collector.set(dict(labels), value)

    def remove(self, labels: dict) -> None:
        """Drop the series of one replica (aioprometheus has no public removal)."""
        for collector in self._collectors.values():
            collector.values.pop(dict(labels), None)


def _patch_metrics(module: ModuleType) -> bool:
    """Put a :class:`XavierMetricsSink` into ``xinference.core.metrics`` under
    :data:`METRICS_SINK`.  Idempotent; an upstream without ``record_metrics`` is logged."""
    if not callable(getattr(module, "record_metrics", None)):
        logger.warning("xavier overlay: %s.record_metrics not found; Xavier's counters are "
                       "not in the worker's metrics", METRICS_MODULE)
        return False
    if not isinstance(getattr(module, METRICS_SINK, None), XavierMetricsSink):
        setattr(module, METRICS_SINK, XavierMetricsSink())
    return True


def _patch_cmdline(module: ModuleType) -> bool:
    """Wrap the callback of ``xinference launch`` (``model_launch``) so that a launch with
    ``enable_xavier`` waits for the whole launch on the server: upstream's CLI launches with
    ``wait_ready=False`` and stops when every replica's engine is loaded, exiting 0 even when
    Xavier's attach, which comes after, fails and rolls the launch back.  For such a launch
    the wrapped ``RESTfulClient.launch_model`` is called with ``wait_ready=True`` (no
    progress bar; a line says so) and a failure exits with status 1 and the server's
    message (click's ``ClickException``).  Other launches are untouched.  Idempotent;
    another shape of upstream's CLI is logged and left alone."""
    command = getattr(module, "model_launch", None)
    callback = getattr(command, "callback", None)
    client_cls: Any = getattr(module, "RESTfulClient", None)
    if not callable(callback) or not callable(getattr(client_cls, "launch_model", None)):
        logger.warning("xavier overlay: %s.model_launch or RESTfulClient.launch_model not "
                       "found; a failed Xavier launch may exit 0", CMDLINE_MODULE)
        return False
    if getattr(callback, "_xavier_overlay", False):
        return True

    @functools.wraps(callback)
    def launch(*args: Any, **kwargs: Any) -> Any:
        import click

        from xinference.model.llm.vllm.xavier.planning.launch_checks import (
            asks_for_xavier,
            error_text,
        )

        upstream = client_cls.launch_model

        def wait_for_xavier(client: Any, *a: Any, **kw: Any) -> Any:
            if not asks_for_xavier(kw):
                return upstream(client, *a, **kw)
            kw["wait_ready"] = True
            print("Launching with Xavier: waiting until every replica is loaded and attached",
                  file=sys.stderr)
            try:
                return upstream(client, *a, **kw)
            except RuntimeError as exc:
                raise click.ClickException(
                    f"the Xavier launch failed: {error_text(str(exc))}") from None

        client_cls.launch_model = wait_for_xavier
        try:
            return callback(*args, **kwargs)
        finally:
            client_cls.launch_model = upstream

    launch._xavier_overlay = True  # type: ignore[attr-defined]
    command.callback = launch  # type: ignore[union-attr]
    return True


#: upstream modules wrapped when imported, and how
_PATCHES = {WORKER_MODULE: _patch_worker, SUPERVISOR_MODULE: _patch_supervisor,
            METRICS_MODULE: _patch_metrics, CMDLINE_MODULE: _patch_cmdline,
            API_MODULE: _patch_api}


class _HookLoader:
    """Runs the real loader, then patches the module (see :data:`_PATCHES`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            _PATCHES[module.__name__](module)
        except Exception as exc:
            logger.warning("xavier overlay: patching %s failed: %s", module.__name__, exc)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real one
        return getattr(self._inner, name)


class _WorkerHook:
    """Meta-path finder that only wraps the loaders of the modules in :data:`_PATCHES`."""

    @classmethod
    def find_spec(cls, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookLoader(spec.loader)  # type: ignore[assignment]
        return spec


def is_active() -> bool:
    return any(f is XavierOverlayFinder for f in sys.meta_path)
