"""Cache-aware replica routing wired into Xinference 3.5.0 (#37): the REST layer asks
:class:`~.planning.routing.ReplicaRouter` where a request goes, the supervisor hands out
that replica.  Installed by the import overlay (``_xinference_xavier_overlay.py``), never
by editing upstream's files.

Path of one ``POST /v1/chat/completions`` or ``/v1/completions`` (the OpenAI client, the
web UI and Xinference's own client all come this way):

1. :meth:`ApiRouting.begin`, in a wrapper of the handler: reads the body (Starlette keeps
   it for the handler), asks the model's router (:func:`supervisor_route_info`: which models were
   launched with Xavier and ``xavier_routing`` ``cache_aware``, with the launch's id and
   their live replicas; asked again when a second old) and keeps the
   choice in a context variable;
2. upstream's handler calls ``require_model``, which the overlay replaced in
   ``restful_api``'s namespace by :meth:`ApiRouting.require_model`: the chosen replica's
   model actor (:func:`supervisor_replica_model`), or upstream's round-robin one when
   routing failed (counted ``fallback``; the request never fails for it);
3. :meth:`ApiRouting.attach_end`: the request's end (a streamed one's when its stream ends)
   takes it out of the router's in-flight count.

Counters: ``xinference_xavier_routed_requests_total{model, replica, reason}`` on the API's
``/metrics`` (reason ``affinity``, ``load`` or ``fallback``; replica ``-1`` when a fallback
had no replica yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple

from .planning.log_names import package_logger
from .planning.routing import ReplicaRouter, chunk_chain, prompt_text

logger = package_logger(__name__)

#: how long the live replicas of a model are taken from the last answer (s)
INFO_TTL_S = 1.0
#: how long one call for a model's live replicas may take (s)
INFO_CALL_TIMEOUT_S = 5.0
#: models whose answers are kept (the oldest forgotten past it)
MAX_MODELS = 1024
#: the counter on the API's ``/metrics``
ROUTED_METRIC = "xinference_xavier_routed_requests_total"


@dataclass
class Routed:
    """One request's routing, from the handler's start to its end."""

    model_uid: str
    replica: Optional[int]
    router: ReplicaRouter
    uncached_chars: int = 0
    ended: bool = False
    launch: Optional[str] = None


_ROUTED: contextvars.ContextVar[Optional[Routed]] = contextvars.ContextVar(
    "xavier_routed", default=None)


# ---------------------------------------------------------------------- supervisor side
def supervisor_record_routing(supervisor: Any, model_uid: str, policy: Optional[str]) -> None:
    """Remember how ``model_uid`` routes (None: not a Xavier launch: Xinference's cycle),
    with a fresh id of this launch (a relaunch under the same uid is another model: what
    the API's router knew of the last one is dropped)."""
    table: Dict[str, Tuple[str, str]] = supervisor.__dict__.setdefault("_xavier_routing", {})
    if policy is None:
        table.pop(model_uid, None)
    else:
        table[model_uid] = (policy, secrets.token_hex(8))


def _launch_of(supervisor: Any, model_uid: str) -> Optional[str]:
    """The id of ``model_uid``'s launch when it routes ``cache_aware``, else None."""
    policy, launch = supervisor.__dict__.get("_xavier_routing", {}).get(model_uid, (None, None))
    return launch if policy == "cache_aware" else None


#: what a replica's worker reports while it does not serve (Xinference's
#: ``ReplicaStatus.model_state``; 3.5.0's worker reports a replica whose process died
#: "stopping" until its reload is "ready")
NOT_SERVING_STATES = frozenset({"registering", "loading", "error", "stopping", "stopped"})


async def supervisor_route_info(supervisor: Any, module: Any,
                                model_uid: str) -> Optional[Tuple[str, List[int]]]:
    """``(launch id, live replica ids)`` of ``model_uid`` when it routes ``cache_aware``,
    else None.  Live: active, with a worker, and not reported out of service by its worker
    (:data:`NOT_SERVING_STATES`; Xinference keeps a replica whose process died in its
    replica list and its round robin while the worker recovers it, and answers a request
    sent there with an error)."""
    launch = _launch_of(supervisor, model_uid)
    info = supervisor._model_uid_to_replica_info.get(model_uid)
    if launch is None or info is None:
        return None
    workers = supervisor._replica_model_uid_to_worker
    live = [int(r) for r in info.active_replica_ids
            if workers.get(module.build_replica_model_uid(model_uid, r)) is not None]
    out = await _replicas_out_of_service(supervisor, model_uid)
    known = supervisor.__dict__.setdefault("_xavier_out_of_service", {})
    if known.get(model_uid, set()) != out:  # (said once per change: asked every second)
        known[model_uid] = out
        logger.warning("xavier routing of %s: replicas out of service (their workers say "
                       "so): %s", model_uid, sorted(out) or "none")
    live = [r for r in live if r not in out]
    return (launch, live) if live else None


async def _replicas_out_of_service(supervisor: Any, model_uid: str) -> Set[int]:
    """Replica ids the status guard lists in a :data:`NOT_SERVING_STATES` state (none
    when it cannot be asked: routing goes on as before)."""
    try:
        statuses = await supervisor._status_guard_ref.get_replica_statuses(model_uid)
        return {int(s.replica_id) for s in statuses
                if getattr(s, "model_state", "") in NOT_SERVING_STATES}
    except Exception as exc:
        logger.debug("xavier routing: replica states of %s: %r", model_uid, exc)
        return set()


async def supervisor_replica_model(supervisor: Any, module: Any, model_uid: str,
                                   replica_id: int, launch: Optional[str] = None) -> Any:
    """The model actor of replica ``replica_id`` of ``model_uid`` (what upstream's
    ``get_model`` returns for the replica its cycle picks); ``LookupError`` when that
    replica is not live, or ``model_uid`` is no more the launch ``launch`` names."""
    if launch is not None and _launch_of(supervisor, model_uid) != launch:
        raise LookupError(f"launch: {model_uid} was relaunched (or is no more routed)")
    info = supervisor._model_uid_to_replica_info.get(model_uid)
    if info is None or replica_id not in info.active_replica_ids:
        raise LookupError(f"replica: {replica_id} of {model_uid} is not live")
    replica_uid = module.build_replica_model_uid(model_uid, replica_id)
    worker_ref = supervisor._replica_model_uid_to_worker.get(replica_uid)
    if worker_ref is None:
        raise LookupError(f"replica: {replica_uid} has no worker yet")
    if isinstance(worker_ref, (list, tuple)):
        worker_ref = worker_ref[0]
    return await module.xo.wait_for(
        module.actor_call(worker_ref, "get_model", model_uid=replica_uid),
        module.XINFERENCE_GET_MODEL_RPC_TIMEOUT)


async def _replica_model(supervisor: Any, model_uid: str, replica: int,
                         launch: Optional[str]) -> Any:
    """The chosen replica's model actor, as upstream's ``require_model`` returns one: the
    call and the reference correlated with the request's id where Xinference has one."""
    try:
        from xinference.api.model_request_logging import get_current_model_request_id
        from xinference.core.rpc_context import actor_call, correlate_model_ref
    except ImportError:  # (another Xinference)
        return await supervisor.xavier_replica_model(model_uid, replica, launch)
    request_id = get_current_model_request_id()
    if request_id is None:
        return await supervisor.xavier_replica_model(model_uid, replica, launch)
    ref = await actor_call(supervisor, "xavier_replica_model", model_uid, replica, launch,
                           _rpc_correlation_id=request_id)
    return correlate_model_ref(ref, request_id)


# ---------------------------------------------------------------------- API side
class ApiRouting:
    """The API process's routers, one per model (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.routers: Dict[str, ReplicaRouter] = {}
        self._launches: Dict[str, str] = {}  # model -> the launch its router knows
        self._info: Dict[str, Tuple[float, Optional[Tuple[str, List[int]]]]] = {}
        self._asking: Dict[str, asyncio.Future[Optional[Tuple[str, List[int]]]]] = {}
        self._clock = clock
        self._counter: Any = None

    # -------------------------------------------------------------- the handler
    async def begin(self, api: Any, request: Any) -> Optional[Routed]:
        """Route the request if its model routes ``cache_aware``; never raises (None:
        upstream's path unchanged)."""
        model_uid = None
        try:
            body = await request.json()
            if not isinstance(body, dict):
                return None
            model_uid = body.get("model")
            if not isinstance(model_uid, str):
                return None
            info = await self._replicas(api, model_uid)
            if not info:
                self.routers.pop(model_uid, None)  # not (or no more) routed: forgotten
                return None
            launch, replicas = info
            text = prompt_text(body) or ""
            router = self.routers.get(model_uid)
            if router is None or self._launches.get(model_uid) != launch:
                router = self.routers[model_uid] = ReplicaRouter()  # another launch
                self._launches[model_uid] = launch
            router.forget(replicas)
            decision = router.route(chunk_chain(text), len(text), replicas)
            self._count(model_uid, decision.replica, decision.reason)
            return Routed(model_uid, decision.replica, router,
                          len(text) - decision.matched_chars, launch=launch)
        except Exception as exc:  # routing never fails a request
            if model_uid is not None:
                logger.warning("xavier routing of %s failed, round robin: %r", model_uid, exc)
                known = self.routers.get(model_uid)
                if known is not None:
                    known.fallback(None)
                self._count(model_uid, -1, "fallback")
            return None

    async def require_model(self, original: Callable[..., Awaitable[Any]],
                            get_supervisor_ref: Callable[[], Awaitable[Any]], model_uid: str,
                            report_error_event: Optional[Callable] = None) -> Any:
        """Upstream's ``require_model`` for the replica this request was routed to."""
        routed = _ROUTED.get()
        if routed is None or routed.model_uid != model_uid or routed.replica is None:
            return await original(get_supervisor_ref, model_uid, report_error_event)
        try:
            return await _replica_model(await get_supervisor_ref(), model_uid, routed.replica,
                                        routed.launch)
        except Exception as exc:
            logger.warning("xavier routing: replica %s of %s unavailable, round robin: %r",
                           routed.replica, model_uid, exc)
            self._info.pop(model_uid, None)  # its live replicas asked again next time
            self.end(routed)
            router = routed.router
            router.forget([r for r in router.in_flight() if r != routed.replica])
            router.fallback(routed.replica)
            self._count(model_uid, routed.replica, "fallback")
            routed.replica = None
            return await original(get_supervisor_ref, model_uid, report_error_event)

    def end(self, routed: Optional[Routed]) -> None:
        """The request ended: out of its replica's in-flight count (once)."""
        if routed is None or routed.ended or routed.replica is None:
            return
        routed.ended = True
        routed.router.finished(routed.replica, routed.uncached_chars)

    def attach_end(self, response: Any, routed: Optional[Routed]) -> Any:
        """End ``routed`` when ``response`` is done: now, or when its stream ends."""
        body = getattr(response, "body_iterator", None)
        if routed is None or body is None:
            self.end(routed)
            return response

        async def streamed() -> Any:
            try:
                async for chunk in body:
                    yield chunk
            finally:
                self.end(routed)
                with contextlib.suppress(Exception):  # upstream's own clean-up (its abort of
                    await body.aclose()  # the vLLM request) runs now, not at collection

        response.body_iterator = streamed()
        # a stream that never starts (the client left while the handler still awaited)
        # runs no finally: the response's collection ends the request then
        weakref.finalize(response, self.end, routed)
        return response

    # -------------------------------------------------------------- internals
    async def _replicas(self, api: Any,
                        model_uid: str) -> Optional[Tuple[str, List[int]]]:
        """``(launch, live replicas)`` of a ``cache_aware`` model, or None: the last
        answer while it is younger than :data:`INFO_TTL_S`, else asked again and waited for
        (one call per model at a time: about one a second per model on a request's path;
        an answer from before a relaunch is never used for the relaunched model, whose
        launch takes longer than that)."""
        cached = self._info.get(model_uid)
        if cached is None or self._clock() - cached[0] > INFO_TTL_S:
            return await self._ask(api, model_uid)
        return cached[1]

    async def _ask(self, api: Any, model_uid: str) -> Optional[Tuple[str, List[int]]]:
        pending = self._asking.get(model_uid)
        if pending is None:
            pending = self._asking[model_uid] = asyncio.ensure_future(
                self._ask_now(api, model_uid))
            pending.add_done_callback(lambda _t: self._asking.pop(model_uid, None))
        return await asyncio.shield(pending)

    async def _ask_now(self, api: Any, model_uid: str) -> Optional[Tuple[str, List[int]]]:
        """One call to the supervisor; a failed one keeps the last answer (asked again after
        :data:`INFO_TTL_S`), or "not routed" when there is none."""
        previous = self._info.get(model_uid)
        try:
            supervisor = await api._get_supervisor_ref()
            answer = await asyncio.wait_for(supervisor.xavier_route_info(model_uid),
                                            INFO_CALL_TIMEOUT_S)
            info = (str(answer[0]), [int(r) for r in answer[1]]) if answer else None
        except Exception as exc:
            logger.debug("xavier routing: no route info for %s: %r", model_uid, exc)
            info = previous[1] if previous is not None else None
        self._info[model_uid] = (self._clock(), info)
        while len(self._info) > MAX_MODELS:  # (a client may name any uid)
            oldest = next(iter(self._info))
            self._info.pop(oldest)
            self.routers.pop(oldest, None)
            self._launches.pop(oldest, None)
        return info

    def _count(self, model_uid: str, replica: int, reason: str) -> None:
        try:
            if self._counter is None:
                from aioprometheus import Counter

                self._counter = Counter(ROUTED_METRIC, "requests routed to a replica by "
                                                       "Xavier's router, by reason")
            self._counter.inc({"model": model_uid, "replica": str(replica), "reason": reason})
        except Exception as exc:  # a metrics problem never fails a request
            logger.debug("xavier routing: counter: %r", exc)


#: the API process's routing (one per process)
API_ROUTING = ApiRouting()


def wrap_handler(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``RESTfulAPI.create_chat_completion`` / ``create_completion`` routed."""

    @functools.wraps(handler)  # (FastAPI reads the handler's signature through __wrapped__)
    async def routed_handler(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        routed = await API_ROUTING.begin(self, request)
        token = _ROUTED.set(routed)
        try:
            response = await handler(self, request, *args, **kwargs)
        except BaseException:
            API_ROUTING.end(routed)
            raise
        finally:
            _ROUTED.reset(token)
        return API_ROUTING.attach_end(response, routed)

    return routed_handler
