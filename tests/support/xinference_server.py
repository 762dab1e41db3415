"""A real ``xinference-local`` (3.5.0) on loopback for tests, and what they do with it: launch
bodies, the ``xinference`` CLI, the worker's metrics endpoint (see ``test_xinference_local.py``,
``test_web_ui.py``)."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Optional, Sequence

import psutil

from .pools import free_port, gpus_from_env
from .processes import engine_cores, processes_below

MODEL = "qwen2.5-instruct"
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
#: ``xinference-local`` as a user runs it: the console script beside this interpreter, or
#: (where packages were unpacked with ``pip --target``, the GPU machine) its entry point
LOCAL_SCRIPT = os.path.join(os.path.dirname(sys.executable), "xinference-local")
LOCAL_CMD = ([LOCAL_SCRIPT] if os.path.exists(LOCAL_SCRIPT) else
             [sys.executable, "-c",
              "import sys; from xinference.deploy.cmdline import local; sys.exit(local())"])


#: a client of one actor method in a process of its own: the key of its environment is the
#: one it signs frames with (xoscar reads ``XOSCAR_AUTH_KEY`` per frame, process-wide, so the
#: test process, which also talks to pools without a key, never sets it)
ACTOR_CLIENT = r"""
import asyncio, json, sys
import xoscar as xo

async def main():
    ref = await xo.actor_ref(sys.argv[1], sys.argv[2])
    args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else []
    answer = await asyncio.wait_for(getattr(ref, sys.argv[3])(*args), 60)
    try:
        print("ANSWER " + json.dumps(answer), flush=True)
    except TypeError:  # (an actor ref)
        print("ANSWER " + json.dumps(repr(answer)), flush=True)

try:
    asyncio.run(main())
except BaseException as exc:
    print("REFUSED", type(exc).__name__, str(exc)[:200], flush=True)
"""


class Server:
    """``xinference-local`` in its own process group, its log in ``home``; one serves every
    test that needs it (the ``xinference_server`` fixture, ``tests/support/worlds.py``).
    Started as an authenticated deployment (issue #36): ``XOSCAR_AUTH_KEY`` (a fresh random
    key) in its environment, inherited by every pool and vLLM engine it starts, so every
    test of a launch through it (hits included) runs with xoscar's frame authentication."""

    def __init__(self, home: str) -> None:
        self.home = home
        self._log_mark = 0
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.auth_key = secrets.token_hex(16)
        # Xinference's own start-up check gives its cluster 5 checks 5 s apart; on a loaded
        # 2-core machine (engine tests of the other xdist worker starting) that was too
        # short (session 42's CI55: "Cluster is not available after multiple attempts")
        env = dict(os.environ, XINFERENCE_HOME=home, PYTHONUNBUFFERED="1",
                   XOSCAR_AUTH_KEY=self.auth_key, XINFERENCE_HEALTH_CHECK_FAILURE_THRESHOLD="30")
        self.log = open(os.path.join(home, "xinference-local.log"), "w")
        self.proc = subprocess.Popen(
            LOCAL_CMD + ["--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.token = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                self.call("GET", "/status")
                break
            except Exception:
                if self.proc.poll() is not None:  # (gave up: its log says why)
                    raise RuntimeError(f"xinference-local exited ({self.proc.returncode}) "
                                       f"before answering /status; see {self.log.name}") from None
                time.sleep(1)
        else:
            raise RuntimeError("xinference-local did not answer /status")
        self.call("POST", "/v1/admin/setup", {"username": "admin", "password": "xavier-test-pw"})
        self.token = self.call("POST", "/token",
                               {"username": "admin", "password": "xavier-test-pw"})["access_token"]

    def call(self, method, path, body=None, timeout=600):
        req = urllib.request.Request(self.base + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.token}"}
                                                 if self.token else {})})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def launch(self, body, wait_for_worker_s=120):
        """POST /v1/models; while the local worker has not joined yet Xinference answers
        503 ("No available worker found"): try again."""
        deadline = time.monotonic() + wait_for_worker_s
        while True:
            try:
                return self.call("POST", "/v1/models", body)
            except urllib.error.HTTPError as exc:
                if exc.code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(2)

    def actor_call(self, address: str, uid: str, method: str, key: Optional[str] = "",
                   args: Sequence[Any] = ()) -> str:
        """``method(*args)`` of actor ``uid`` at ``address``, called from a process whose key
        is ``key`` ("": the server's, None: none); the answer line: ``ANSWER <json>`` (an
        answer JSON cannot carry: its ``repr``) or ``REFUSED <error>``."""
        env = dict(os.environ)
        env.pop("XOSCAR_AUTH_KEY", None)
        if key is not None:
            env["XOSCAR_AUTH_KEY"] = key or self.auth_key
        out = subprocess.run([sys.executable, "-c", ACTOR_CLIENT, address, uid, method,
                              json.dumps(list(args))],
                             env=env, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("ANSWER", "REFUSED"))]
        assert lines, out.stderr[-2000:]
        return lines[-1]

    def counters(self, address: str, rank: int) -> Dict[str, int]:
        """Rank ``rank``'s transfer actor's counters (a client with the cluster's key)."""
        line = self.actor_call(address, f"vllm-transfer-actor-{rank}", "counters")
        assert line.startswith("ANSWER "), line
        return json.loads(line[len("ANSWER "):])

    def begin_test(self) -> None:
        """Between two tests: no model is left running (a failed test may leave one: it is
        terminated), and :meth:`log_lines` counts from here."""
        for model in self.call("GET", "/v1/models")["data"]:
            self.call("DELETE", f"/v1/models/{model['id']}")
        if self.engines_gone():
            raise RuntimeError(f"engines still running after their models were terminated: "
                               f"{self.engine_cores()}")
        self._log_mark = os.path.getsize(os.path.join(self.home, "xinference-local.log"))

    def log_lines(self, needle):
        """The lines of the server's log since :meth:`begin_test` that contain ``needle``."""
        with open(os.path.join(self.home, "xinference-local.log"), "rb") as f:
            f.seek(self._log_mark)
            text = f.read().decode(errors="replace")
        return [line for line in text.splitlines(keepends=True) if needle in line]

    def engine_cores(self):
        return engine_cores(self.proc.pid)

    def engines_gone(self, timeout: float = 60.0):
        """vLLM engine cores still running after ``timeout`` s (none, once a model is
        terminated or a launch rolled back)."""
        deadline = time.monotonic() + timeout
        while self.engine_cores() and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.engine_cores()

    def stop(self) -> None:
        keep = os.environ.get("XAVIER_TEST_LOG_DIR")  # the GPU script collects the log
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        if keep:
            import shutil

            shutil.copy(self.log.name, keep)


def launch_body(model_dir, envs):
    body = {"model_engine": "vllm", "model_name": MODEL, "model_size_in_billions": "0_5",
            "model_type": "LLM", "model_format": "pytorch", "model_path": model_dir,
            "replica": 2, "enable_xavier": True, "enable_virtual_env": False, "envs": envs,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_model_len": 2048,
            "enforce_eager": True, "block_size": 16, "dtype": "bfloat16", "max_num_seqs": 16}
    if DEVICE == "cuda":
        body.update(gpu_idx=[int(g) for g in (gpus_from_env() or ["0", "0"])],
                    attention_backend="TRITON_ATTN", gpu_memory_utilization=0.25)
    return body


def xavier_envs():
    """Xavier's options as launch ``envs`` (what a user puts in the web UI or REST body)."""
    if DEVICE == "cuda":
        return {"XAVIER_CPU_BUDGET": "64MiB", "XAVIER_GPU_BUDGET": "256MiB"}
    return {"XAVIER_CPU_BUDGET": "64MiB", "XAVIER_GPU_BUDGET": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


#: ``xinference`` as a user runs it (see LOCAL_CMD)
CLI_SCRIPT = os.path.join(os.path.dirname(sys.executable), "xinference")
CLI_CMD = ([CLI_SCRIPT] if os.path.exists(CLI_SCRIPT) else
           [sys.executable, "-c", "from xinference.deploy.cmdline import cli; cli()"])


def cli_launch(server, model_dir, *xavier_args):
    """``xinference launch`` of the tiny model with two replicas and ``xavier_args``."""
    args = ["launch", "--endpoint", server.base, "--api-key", server.token,
            "--model-engine", "vllm", "--model-name", MODEL, "--size-in-billions", "0_5",
            "--model-format", "pytorch", "--model-path", model_dir, "--replica", "2",
            "--disable-virtual-env", "--env", "XAVIER_GPU_BUDGET", "0",
            "--env", "VLLM_CPU_KVCACHE_SPACE", "1", *xavier_args,
            "--tensor_parallel_size", "1", "--pipeline_parallel_size", "1",
            "--max_model_len", "2048", "--enforce_eager", "true", "--block_size", "16",
            "--dtype", "bfloat16", "--max_num_seqs", "16"]
    return subprocess.run(CLI_CMD + args, capture_output=True, text=True, timeout=600)


def log_lines(home, needle):
    with open(os.path.join(home, "xinference-local.log")) as f:
        return [line for line in f if needle in line]


def metrics_endpoint(home):
    """The worker's metrics endpoint, from its start-up line in the log."""
    (line,) = log_lines(home, "Metrics server is started at:")[-1:]
    return line.rsplit("started at:", 1)[1].strip().replace("0.0.0.0", "127.0.0.1") + "/metrics"


def scrape(endpoint, metric):
    """``[(labels, value)]`` of ``metric`` in a Prometheus text scrape of ``endpoint``."""
    with urllib.request.urlopen(endpoint, timeout=30) as r:
        return parse_metric(r.read().decode(), metric)


def parse_metric(text, metric):
    """``[(labels, value)]`` of ``metric`` in the Prometheus text ``text``."""
    out = []
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body, value = line[len(metric) + 1:].rsplit("} ", 1)
            labels = dict(item.split("=", 1) for item in body.split(","))
            out.append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


#: Xavier's router's counter on the API's ``/metrics`` (``replica_routing.py``)
ROUTED = "xinference_xavier_routed_requests_total"


def routed(server, since=None):
    """``{(replica, reason): requests}`` of :data:`MODEL` from the API's ``/metrics``
    (Xavier's router), less ``since`` (an earlier answer: the API's counters live as long as
    the server)."""
    return routed_in(scrape(server.base + "/metrics", ROUTED), since)


def routed_in(samples, since=None):
    """:func:`routed` from ``samples`` of :data:`ROUTED` (as :func:`parse_metric` gives)."""
    now = {(labels["replica"], labels["reason"]): int(value)
           for labels, value in samples if labels.get("model") == MODEL}
    since = since or {}
    return {k: v - since.get(k, 0) for k, v in now.items() if v - since.get(k, 0)}


def wait_for_series(endpoint, metric, count, timeout):
    """:func:`scrape` until ``count`` series are there (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        found = scrape(endpoint, metric)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(1)


def model_process(server: Server, replica: int) -> psutil.Process:
    """The process of replica ``replica``'s model actor (Xinference titles it
    ``Model: <uid>-rep<replica>``)."""
    title = f"Model: {MODEL}-rep{replica}"
    found = processes_below(server.proc.pid, lambda cmdline: cmdline.startswith(title))
    assert len(found) == 1, (title, found)
    return found[0]


def replica_statuses(server: Server) -> Dict[int, str]:
    """Xinference's status of each replica of :data:`MODEL` (``READY``, ``LOADING``,
    ``TERMINATING``, ...), as ``GET /v1/models/<uid>/replicas`` answers it."""
    return {int(r["replica_id"]): r["status"]
            for r in server.call("GET", f"/v1/models/{MODEL}/replicas")}
