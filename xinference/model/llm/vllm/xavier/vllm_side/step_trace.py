"""Where a hit's time goes, step by step: a trace of every call vLLM makes into the connector.

Off unless ``XAVIER_STEP_TRACE`` names a folder (:mod:`..planning.trace_spans`: the file,
and the spans of Xavier's own work beside these lines).  Then each engine process appends
one JSON line per connector call: the method, its start and end on the monotonic clock, the
calling thread's CPU time in between (``cpu``, ns), and what identifies the step or the
request (every id: scheduled tokens per request, the loads reported done).  A diagnostic for
a benchmark run, not for production: a line costs a write system call (a few µs) on vLLM's
step thread.  ``scripts/step_trace_report.py`` reads the files back and splits each hit's
wait from the lookup to its first forward.

Installed on the connector instance (:func:`install`): vLLM calls the instance's methods,
so wrapping them there leaves the class and every other engine untouched."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Dict

from ..planning.log_names import package_logger
from ..planning.trace_spans import ENV_STEP_TRACE, TraceFile, trace_file

logger = package_logger(__name__)

__all__ = ["ENV_STEP_TRACE", "FIELDS", "install"]


def _rid(request: Any) -> str:
    return str(getattr(request, "request_id", "?"))


def _scheduled(scheduler_output: Any) -> Dict[str, Any]:
    tokens = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
    return {"tokens": int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
            "reqs": {str(r): int(n) for r, n in tokens.items()}}


def _recving(connector_output: Any) -> Dict[str, Any]:
    done = getattr(connector_output, "finished_recving", None) or ()
    return {"done": sorted(str(r) for r in done)}


def _finished(result: Any) -> Dict[str, Any]:
    done = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    return {"done": sorted(str(r) for r in (done or ()))}


#: method -> what its line records: (arguments, result) -> fields
FIELDS: Dict[str, Callable[[tuple, Any], Dict[str, Any]]] = {
    "on_new_request": lambda a, r: {"req": _rid(a[0])},
    "get_num_new_matched_tokens": lambda a, r: {"req": _rid(a[0]), "local": int(a[1]),
                                                "ext": None if r[0] is None else int(r[0])},
    "update_state_after_alloc": lambda a, r: {"req": _rid(a[0]), "ext": int(a[2])},
    "build_connector_meta": lambda a, r: _scheduled(a[0]),
    "update_connector_output": lambda a, r: _recving(a[0]),
    "request_finished": lambda a, r: {"req": _rid(a[0])},
    "start_load_kv": lambda a, r: {},
    "wait_for_save": lambda a, r: {},
    "get_finished": lambda a, r: _finished(r),
}


def install(connector: Any, rank: int, role: str) -> bool:
    """Wrap ``connector``'s methods in :data:`FIELDS` so that each call leaves a line (with
    the replica's ``rank``: its scheduler and workers may be different processes), when
    ``XAVIER_STEP_TRACE`` is set and its folder can be written; returns whether it was (a
    folder that cannot be written is logged: the engine serves untraced)."""
    try:
        trace = trace_file()
    except OSError as exc:
        logger.warning("xavier: %s: no step trace (%r)", ENV_STEP_TRACE, exc)
        return False
    if trace is None:
        return False
    for method, fields in FIELDS.items():
        bound = getattr(connector, method, None)
        if bound is not None:
            setattr(connector, method, _wrapped(trace, rank, role, method, bound, fields))
    return True


def _wrapped(trace: TraceFile, rank: int, role: str, method: str, bound: Callable[..., Any],
             fields: Callable[[tuple, Any], Dict[str, Any]]) -> Callable[..., Any]:
    @functools.wraps(bound)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.monotonic_ns(), time.thread_time_ns()
        result = bound(*args, **kwargs)
        t1, c1 = time.monotonic_ns(), time.thread_time_ns()
        try:  # a trace never fails vLLM's call (the call itself has run)
            try:
                extra = fields(args, result)
            except Exception as e:
                extra = {"trace_error": repr(e)}
            trace.line(rank, role, method, t0, t1, {"cpu": c1 - c0, **extra})
        except Exception as e:  # a full disk, a value JSON cannot hold
            logger.debug("xavier: step trace line lost: %r", e)
        return result

    return call
