"""The router wired into Xinference's API (replica_routing.py), around stand-ins of the
supervisor and of Starlette's request for the faults the real-part test
(``test_xinference_local.py``, routed by cache on a real ``xinference-local``) cannot cause:
a chosen replica that is gone (the request goes round robin, counted, never failed), a body
that is no JSON, a stream that ends late, a supervisor that stops answering."""

import asyncio

import pytest

from xinference.model.llm.vllm.xavier import replica_routing
from xinference.model.llm.vllm.xavier.replica_routing import ApiRouting, wrap_handler

PROMPT = "You are a careful assistant. " * 100


class Request:
    def __init__(self, body):
        self._body = body

    async def json(self):
        if isinstance(self._body, Exception):
            raise self._body
        return self._body


class Supervisor:
    def __init__(self, replicas=(0, 1)):
        self.replicas = list(replicas)
        self.gone = set()
        self.info_calls = 0

    launch = "launch-1"

    async def xavier_route_info(self, uid):
        self.info_calls += 1
        if isinstance(self.replicas, Exception):
            raise self.replicas
        return (self.launch, self.replicas) if uid == "m" and self.replicas else None

    async def xavier_replica_model(self, uid, replica, launch=None):
        if replica in self.gone or launch != self.launch:
            raise LookupError(f"replica: {replica} of {uid} is not live")
        return f"replica-{replica}"


class Api:
    def __init__(self, supervisor):
        self.supervisor = supervisor

    async def _get_supervisor_ref(self):
        return self.supervisor


async def upstream_require_model(get_ref, uid, report=None):
    return "round-robin"


def serve(routing, api, body):
    """One request through a wrapped handler that, as upstream's does, calls
    ``require_model`` in its body; returns (the model it got, the response)."""
    got = {}

    async def handler(self, request):
        got["model"] = await routing.require_model(upstream_require_model,
                                                   self._get_supervisor_ref, body.get("model"))
        return "response"

    async def run():
        replica_routing.API_ROUTING, saved = routing, replica_routing.API_ROUTING
        try:
            return await wrap_handler(handler)(api, Request(body))
        finally:
            replica_routing.API_ROUTING = saved

    return got.get("model") if asyncio.run(run()) else None, got


def test_a_follow_up_gets_the_replica_its_prefix_went_to_and_ends_in_flight():
    routing, api = ApiRouting(), Api(Supervisor())
    body = {"model": "m", "prompt": PROMPT + "one"}
    first, _ = serve(routing, api, body)
    second, _ = serve(routing, api, dict(body, prompt=PROMPT + "two"))
    assert first == second and first.startswith("replica-")
    replica = int(first.split("-")[1])
    assert routing.routers["m"].counts[replica] == {"affinity": 1, "load": 1, "fallback": 0}
    assert routing.routers["m"].in_flight() == {0: 0, 1: 0}  # each ended with its response


def test_a_gone_replica_falls_back_to_round_robin_counted_and_leaves_the_candidates():
    supervisor = Supervisor()
    routing, api = ApiRouting(), Api(supervisor)
    first, _ = serve(routing, api, {"model": "m", "prompt": PROMPT + "one"})
    supervisor.gone.add(int(first.split("-")[1]))
    again, _ = serve(routing, api, {"model": "m", "prompt": PROMPT + "two"})
    assert again == "round-robin"
    router = routing.routers["m"]
    gone = int(first.split("-")[1])
    assert router.counts[gone]["fallback"] == 1
    assert gone not in router.in_flight()  # forgotten at once


@pytest.mark.parametrize("body", [ValueError("no JSON"), ["a", "list"], {"prompt": "no model"},
                                  {"model": "other", "prompt": PROMPT}])
def test_what_is_not_a_routed_request_goes_upstreams_way(body):
    routing, api = ApiRouting(), Api(Supervisor())
    got = asyncio.run(routing.begin(api, Request(body)))
    assert got is None


def test_a_supervisor_that_does_not_answer_is_no_route_and_no_failure():
    supervisor = Supervisor()
    supervisor.replicas = RuntimeError("supervisor gone")
    routing, api = ApiRouting(), Api(supervisor)
    model, _ = serve(routing, api, {"model": "m", "prompt": PROMPT})
    assert model == "round-robin" and "m" not in routing.routers


def test_live_replicas_are_asked_again_once_their_answer_is_a_second_old():
    now = [0.0]
    supervisor = Supervisor()
    routing, api = ApiRouting(clock=lambda: now[0]), Api(supervisor)

    async def three():
        for t in (0.0, 0.5, 1.6):
            now[0] = t
            await routing.begin(api, Request({"model": "m", "prompt": PROMPT}))

    asyncio.run(three())
    assert supervisor.info_calls == 2  # the first, then once it was older than a second


def test_a_relaunch_under_the_same_uid_starts_a_new_router():
    """What the router knew of the last launch (its replicas' prefixes, in-flight counts)
    says nothing of the new one: a new launch id, a new router (CI, session 32: a round-robin
    relaunch had its first request routed by the cache-aware launch's router)."""
    now = [0.0]
    supervisor = Supervisor()
    routing, api = ApiRouting(clock=lambda: now[0]), Api(supervisor)
    a, b = begin_two(routing, api)
    old = routing.routers["m"]
    supervisor.launch = "launch-2"  # relaunched, also cache aware
    now[0] = 60.0
    c = asyncio.run(routing.begin(api, Request({"model": "m", "prompt": PROMPT})))
    assert c.router is not old
    assert routing.routers["m"].counts[c.replica]["load"] == 1  # nothing known: by load
    supervisor.replicas = None  # relaunched round robin
    now[0] = 120.0
    assert asyncio.run(routing.begin(api, Request({"model": "m", "prompt": PROMPT}))) is None
    assert "m" not in routing.routers



def test_a_request_routed_under_a_launch_that_is_gone_goes_round_robin():
    """Routed just before a relaunch: the supervisor refuses the old launch's replica (its
    id names another model now) and the request takes Xinference's cycle, counted."""
    supervisor = Supervisor()
    routing, api = ApiRouting(), Api(supervisor)
    chosen = []

    async def run():
        routed = await routing.begin(api, Request({"model": "m", "prompt": PROMPT}))
        chosen.append(routed.replica)
        supervisor.launch = "launch-2"
        token = replica_routing._ROUTED.set(routed)
        try:
            return routed, await routing.require_model(upstream_require_model,
                                                       api._get_supervisor_ref, "m")
        finally:
            replica_routing._ROUTED.reset(token)

    routed, model = asyncio.run(run())
    assert model == "round-robin" and routed.replica is None
    assert routed.router.counts[chosen[0]]["fallback"] == 1


def streamed_response(log):
    """A response as sse-starlette's: its body an async generator with a clean-up."""
    class Streamed:
        def __init__(self):
            async def chunks():
                try:
                    for c in ("a", "b", "c"):
                        yield c
                finally:
                    log.append("upstream cleaned up")
            self.body_iterator = chunks()
    return Streamed()


def begin_two(routing, api):
    """Two requests of one prompt routed to the same replica (the second by affinity)."""
    async def two():
        a = await routing.begin(api, Request({"model": "m", "prompt": PROMPT}))
        b = await routing.begin(api, Request({"model": "m", "prompt": PROMPT + "more"}))
        return a, b
    a, b = asyncio.run(two())
    assert a.replica == b.replica
    return a, b


def test_a_streamed_response_ends_when_its_stream_does_once():
    """With a second request in flight on the same replica, so that a double end would
    show (the count never goes below 0)."""
    routing, api = ApiRouting(), Api(Supervisor())
    a, b = begin_two(routing, api)
    router, log = routing.routers["m"], []

    async def run():
        response = routing.attach_end(streamed_response(log), a)
        assert router.in_flight()[a.replica] == 2
        assert [c async for c in response.body_iterator] == ["a", "b", "c"]
        assert router.in_flight()[a.replica] == 1
        routing.end(a)  # once only
        assert router.in_flight()[a.replica] == 1

    asyncio.run(run())
    assert log == ["upstream cleaned up"]


def test_a_stream_closed_midway_ends_and_closes_upstreams_stream():
    """A client that leaves mid-stream: the server closes the body iterator; the request
    ends and upstream's generator is closed at once (its clean-up aborts the request)."""
    routing, api = ApiRouting(), Api(Supervisor())
    a, b = begin_two(routing, api)
    router, log = routing.routers["m"], []

    async def run():
        response = routing.attach_end(streamed_response(log), a)
        it = response.body_iterator
        assert await it.__anext__() == "a"
        await it.aclose()
        assert router.in_flight()[a.replica] == 1 and log == ["upstream cleaned up"]

    asyncio.run(run())


def test_a_stream_that_never_starts_ends_when_its_response_is_dropped():
    routing, api = ApiRouting(), Api(Supervisor())
    a, b = begin_two(routing, api)
    router = routing.routers["m"]
    response = routing.attach_end(streamed_response([]), a)
    assert router.in_flight()[a.replica] == 2
    del response
    import gc
    gc.collect()
    assert router.in_flight()[a.replica] == 1


def test_a_handler_that_raises_ends_its_request():
    routing, api = ApiRouting(), Api(Supervisor())

    async def failing(self, request):
        await routing.require_model(upstream_require_model, self._get_supervisor_ref, "m")
        raise RuntimeError("bad request")

    async def run():
        replica_routing.API_ROUTING, saved = routing, replica_routing.API_ROUTING
        try:
            with pytest.raises(RuntimeError):
                await wrap_handler(failing)(api, Request({"model": "m", "prompt": PROMPT}))
        finally:
            replica_routing.API_ROUTING = saved

    asyncio.run(run())
    assert sum(routing.routers["m"].in_flight().values()) == 0


def test_a_supervisor_error_after_an_answer_keeps_the_router():
    """A refresh that fails (a timeout) keeps the last answer: the router, what it knows
    and its in-flight counts stay."""
    now = [0.0]
    supervisor = Supervisor()
    routing, api = ApiRouting(clock=lambda: now[0]), Api(supervisor)
    a, b = begin_two(routing, api)
    router = routing.routers["m"]
    supervisor.replicas = RuntimeError("timeout")
    for t in (1.5, 3.0):
        now[0] = t
        c = asyncio.run(routing.begin(api, Request({"model": "m", "prompt": PROMPT + "x"})))
        assert c is not None and c.replica == a.replica and c.router is router
        routing.end(c)
    assert routing.routers["m"] is router


def test_a_model_not_routed_is_asked_again_on_the_request_path_once_its_answer_is_old():
    """A uid relaunched with routing on (the rows of ``rest_bench.py``: the same uid, round
    robin then cache aware) is routed from the first request after the TTL, not one later."""
    now = [0.0]
    supervisor = Supervisor()
    routing, api = ApiRouting(clock=lambda: now[0]), Api(supervisor)
    supervisor.replicas = None  # launched round robin
    assert asyncio.run(routing.begin(api, Request({"model": "m", "prompt": PROMPT}))) is None
    supervisor.replicas = [0, 1]  # relaunched cache aware
    now[0] = 0.5
    assert asyncio.run(routing.begin(api, Request({"model": "m", "prompt": PROMPT}))) is None
    now[0] = 1.6
    routed = asyncio.run(routing.begin(api, Request({"model": "m", "prompt": PROMPT})))
    assert routed is not None and routed.replica in (0, 1)


def test_a_replica_its_worker_reports_out_of_service_is_not_live():
    """Xinference 3.5.0 keeps a replica whose process died in its replica list and its
    round robin while the worker reloads it (and answers a request sent there with an
    error): the supervisor's route info leaves out the replicas whose worker reports them
    not serving (3.5.0's worker reports "stopping" through the reload; "loading", "error"
    alike), takes them back once "ready", and lists every replica when the status guard
    cannot be asked."""
    from types import SimpleNamespace

    from xinference.model.llm.vllm.xavier.replica_routing import supervisor_route_info

    class Guard:
        states: object = {}

        async def get_replica_statuses(self, uid):
            if isinstance(self.states, Exception):
                raise self.states
            return [SimpleNamespace(replica_id=r, model_state=s)
                    for r, s in self.states.items()]

    guard = Guard()
    supervisor = SimpleNamespace(
        _xavier_routing={"m": ("cache_aware", "launch-1")},
        _model_uid_to_replica_info={"m": SimpleNamespace(active_replica_ids=[0, 1])},
        _replica_model_uid_to_worker={"m-rep0": object(), "m-rep1": object()},
        _status_guard_ref=guard)
    module = SimpleNamespace(build_replica_model_uid=lambda uid, r: f"{uid}-rep{r}")

    def live(states):
        guard.states = states
        return asyncio.run(supervisor_route_info(supervisor, module, "m"))

    assert live({0: "ready", 1: "ready"}) == ("launch-1", [0, 1])
    assert live({0: "ready", 1: "stopping"}) == ("launch-1", [0])
    assert live({0: "ready", 1: "loading"}) == ("launch-1", [0])
    assert live({0: "ready", 1: "ready"}) == ("launch-1", [0, 1])  # recovered
    assert live({0: "error", 1: "stopping"}) is None  # none serves: Xinference's way
    assert live({0: "ready", 1: ""}) == ("launch-1", [0, 1])  # a state never reported
    assert live(ConnectionError("status guard gone")) == ("launch-1", [0, 1])
