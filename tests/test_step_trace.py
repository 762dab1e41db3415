"""The step trace (vllm_side/step_trace.py, ``XAVIER_STEP_TRACE``) and its report
(scripts/step_trace_report.py): a line per connector call, and each hit's wait split at the
moments of vLLM's asynchronous load.  The connector here is a stand-in with the methods'
signatures (the trace wraps whatever instance vLLM holds; a real engine's trace was read
back by the report on CPU and on an H100, doc/benchmarks.md "Session 37")."""

import importlib.util
import json
import os
import sys
from types import SimpleNamespace

import pytest

from xinference.model.llm.vllm.xavier.planning import trace_spans
from xinference.model.llm.vllm.xavier.vllm_side import step_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_report():
    spec = importlib.util.spec_from_file_location(
        "step_trace_report", os.path.join(ROOT, "scripts", "step_trace_report.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_trace_report"] = module
    spec.loader.exec_module(module)
    return module


class Stand:
    """The connector methods the trace wraps, answering as Xavier's would."""

    def __init__(self):
        self.done = set()

    def on_new_request(self, request):
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 32, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return "meta"

    def update_connector_output(self, connector_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        done, self.done = self.done, set()
        return None, (done or None)


@pytest.fixture
def traced(tmp_path, monkeypatch):
    monkeypatch.setenv(step_trace.ENV_STEP_TRACE, str(tmp_path))
    monkeypatch.setattr(trace_spans, "_FILE", None)
    yield tmp_path
    trace_spans._FILE = None


def test_off_without_the_setting(monkeypatch):
    monkeypatch.delenv(step_trace.ENV_STEP_TRACE, raising=False)
    monkeypatch.setattr(trace_spans, "_FILE", None)
    c = Stand()
    assert not step_trace.install(c, 1, "SCHEDULER")
    assert "build_connector_meta" not in vars(c)  # the class's methods, untouched


def test_a_hits_path_is_read_back_and_split_at_each_moment(traced):
    """One hit through a scheduler and a worker of rank 2 (as two processes would write
    them): every call leaves a line with its answer, and the report finds the hit's moments
    in order, the steps between its allocation and its first forward, and each call's time."""
    sched, worker = Stand(), Stand()
    assert step_trace.install(sched, 2, "SCHEDULER") and step_trace.install(worker, 2, "WORKER")
    req = SimpleNamespace(request_id="r-1")
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (32, True)  # answers pass through
    sched.update_state_after_alloc(req, None, 32)
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={},
                                               total_num_scheduled_tokens=0))
    worker.start_load_kv(None)
    worker.done = {"r-1"}
    assert worker.get_finished(set()) == (None, {"r-1"})
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"x": 5},
                                               total_num_scheduled_tokens=5))
    worker.start_load_kv(None)  # (every step reaches the worker)
    worker.get_finished(set())
    sched.update_connector_output(SimpleNamespace(finished_recving={"r-1"}))
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r-1": 16, "x": 1},
                                               total_num_scheduled_tokens=17))
    worker.start_load_kv(None)
    worker.wait_for_save()
    sched.request_finished(req, [])
    lines = [json.loads(x) for p in traced.iterdir() for x in p.read_text().splitlines()]
    assert {x["rank"] for x in lines} == {2}
    assert [x["m"] for x in sorted(lines, key=lambda x: x["t0"])][:4] == [
        "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
        "build_connector_meta"]
    r = load_report().report(str(traced))
    assert r["hits"] == 1
    t = r["example"]["t"]
    moments = [t[p] for p in ("new", "answered", "allocated", "sent", "launched", "reported",
                              "seen", "scheduled", "forward")]
    assert None not in moments and moments == sorted(moments)
    assert [s["tokens"] for s in r["example"]["steps"]] == [0, 5, 17]
    assert r["intervals_ms"]["steps allocated -> scheduled"]["median"] == 2.0
    assert r["call_ms"]["build_connector_meta"]["n"] == 3
    assert load_report().report(str(traced), last=1)["hits"] == 1


def test_a_field_that_cannot_be_read_never_fails_vllms_call(traced):
    class Odd(Stand):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return None  # not a pair: the trace cannot read its answer

    c = Odd()
    step_trace.install(c, 1, "SCHEDULER")
    assert c.build_connector_meta(object()) == "meta"  # no scheduled tokens to read
    assert c.get_num_new_matched_tokens(object(), 0) is None  # passed through
    lines = [json.loads(x) for p in traced.iterdir() for x in p.read_text().splitlines()]
    assert lines[0]["tokens"] == 0 and "TypeError" in lines[1]["trace_error"]


def test_a_trace_that_cannot_be_written_never_fails_the_engine(tmp_path, monkeypatch):
    """A folder that cannot be made: the engine serves untraced; a line that cannot be
    written (a full disk): vLLM's call still returns its answer."""
    monkeypatch.setattr(trace_spans, "_FILE", None)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(step_trace.ENV_STEP_TRACE, str(blocker / "trace"))
    assert not step_trace.install(Stand(), 1, "SCHEDULER")
    monkeypatch.setenv(step_trace.ENV_STEP_TRACE, str(tmp_path / "trace"))
    c = Stand()
    assert step_trace.install(c, 1, "SCHEDULER")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_spans.TraceFile, "line", full)
    assert c.get_num_new_matched_tokens(SimpleNamespace(request_id="r"), 0) == (32, True)
    trace_spans._FILE = None


def test_spans_split_the_launch_into_its_parts_and_name_who_ran_beside_it(traced):
    """Xavier's own work leaves spans with wall and CPU time (:mod:`...trace_spans`): the
    report splits the ``start_load_kv`` that launched a hit into the step thread's spans and
    the other threads' work that overlapped it (here a thread busy through the launch)."""
    import threading
    import time

    class Launching(Stand):
        def start_load_kv(self, forward_context, **kwargs):
            with trace_spans.span(2, "save", blocks=3):
                time.sleep(0.004)  # waiting: wall, no CPU
            with trace_spans.span(2, "load"):
                end = time.thread_time() + 0.003
                while time.thread_time() < end:  # working: CPU
                    pass

    started, stop = threading.Event(), threading.Event()

    def room():
        with trace_spans.span(2, "room.copy", blocks=512):
            started.set()
            stop.wait(5)

    def bridge():  # the actor bridge's span, rank -1 (one bridge per process)
        with trace_spans.span(-1, "bridge"):
            started_bridge.set()
            stop.wait(5)

    started_bridge = threading.Event()
    other = threading.Thread(target=room, name="xavier-room-2")
    other.start()
    on_bridge = threading.Thread(target=bridge, name="xavier-actor-bridge")
    on_bridge.start()
    started.wait(5)
    started_bridge.wait(5)
    sched, worker = Stand(), Launching()
    step_trace.install(sched, 2, "SCHEDULER")
    step_trace.install(worker, 2, "WORKER")
    req = SimpleNamespace(request_id="r-1")
    sched.update_state_after_alloc(req, None, 32)
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={},
                                               total_num_scheduled_tokens=0))
    worker.start_load_kv(None)
    stop.set()
    other.join()
    on_bridge.join()
    lines = [json.loads(x) for p in traced.iterdir() for x in p.read_text().splitlines()]
    span_lines = {x["m"]: x for x in lines if x["role"] == "SPAN"}
    assert span_lines["save"]["blocks"] == 3 and span_lines["room.copy"]["thread"] == \
        "xavier-room-2"
    assert all(x["cpu"] >= 0 for x in lines)
    launch = load_report().report(str(traced))["launch_ms"]
    assert launch["save"]["median"] >= 4.0 and launch["save cpu"]["median"] < 2.0
    assert launch["load cpu"]["median"] >= 2.5
    assert launch["start_load_kv"]["median"] >= 7.0
    assert launch["start_load_kv cpu"]["median"] >= 2.5
    # the room thread's span covered the whole launch
    assert launch["busy: room.copy"]["median"] == pytest.approx(
        launch["start_load_kv"]["median"], rel=0.01)
    assert launch["busy: bridge"]["median"] == pytest.approx(
        launch["start_load_kv"]["median"], rel=0.01)


def test_a_span_is_nothing_when_the_trace_is_off_and_a_line_when_it_is_on(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(trace_spans, "_FILE", None)
    monkeypatch.delenv(trace_spans.ENV_STEP_TRACE, raising=False)
    off = trace_spans.span(1, "save")
    assert off is trace_spans._OFF  # (no clock read, no file)
    with off:
        pass
    assert trace_spans._FILE is None
    monkeypatch.setenv(trace_spans.ENV_STEP_TRACE, str(tmp_path))  # the control: on
    with trace_spans.span(1, "save", blocks=2):
        pass
    lines = [json.loads(x) for p in tmp_path.iterdir() for x in p.read_text().splitlines()]
    assert [(x["m"], x["role"], x["blocks"]) for x in lines] == [("save", "SPAN", 2)]
    trace_spans._FILE = None
