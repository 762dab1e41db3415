"""Real ``xinference-local`` (3.5.0) on loopback, Xavier switched on over REST exactly as a
user does (``"enable_xavier": true`` beside ``"replica": 2``, options as launch ``envs``):
the launch goes through upstream's supervisor, worker and model actor into this fork's hook
classes and two real vLLM CPU engines; a shared prefix computed by one replica is loaded by
the other; termination leaves no engine process and no model; a bad option fails the launch
with a message naming it.

Two settings differ from a GPU launch, both plain launch parameters: ``tensor_parallel_size``
(Xinference defaults it to the number of GPUs, 0 here) and ``enable_virtual_env: false``
(the per-model virtualenv would install GPU wheels from the registry; the overlay inside
such a virtualenv is tested in ``test_overlay_child_venv.py``).

On the GPU machine (``XAVIER_TEST_DEVICE=cuda``, ``scripts/gpu-xinference-local.sh``) the
same test launches vLLM on CUDA: ``gpu_idx`` from ``XAVIER_TEST_GPUS`` (``0,0``: both replicas
on one GPU; ``0,1``: one each; Xinference gives replica ``i`` the ``i``-th), Triton attention
(the vLLM bundle has no flash-attention), a GPU tier of 256 MiB per replica.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import xoscar as xo

from .support.pools import free_port, gpus_from_env
from .support.processes import engine_cores

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-instruct"
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
#: ``xinference-local`` as a user runs it: the console script beside this interpreter, or
#: (where packages were unpacked with ``pip --target``, the GPU machine) its entry point
LOCAL_SCRIPT = os.path.join(os.path.dirname(sys.executable), "xinference-local")
LOCAL_CMD = ([LOCAL_SCRIPT] if os.path.exists(LOCAL_SCRIPT) else
             [sys.executable, "-c",
              "import sys; from xinference.deploy.cmdline import local; sys.exit(local())"])


class Server:
    def __init__(self, home: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, XINFERENCE_HOME=home, PYTHONUNBUFFERED="1")
        self.log = open(os.path.join(home, "xinference-local.log"), "w")
        self.proc = subprocess.Popen(
            LOCAL_CMD + ["--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.token = ""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                self.call("GET", "/status")
                break
            except Exception:
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

    def engine_cores(self):
        return engine_cores(self.proc.pid)

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
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body, value = line[len(metric) + 1:].rsplit("} ", 1)
            labels = dict(item.split("=", 1) for item in body.split(","))
            out.append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def wait_for_series(endpoint, metric, count, timeout):
    """:func:`scrape` until ``count`` series are there (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        found = scrape(endpoint, metric)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(1)


async def counters(address, rank):
    ref = await xo.actor_ref(address, f"vllm-transfer-actor-{rank}")
    return await ref.counters()


def test_rest_launch_shares_prefixes_and_cleans_up(tiny_model_dir, tmp_path):
    import asyncio

    home = str(tmp_path)
    server = Server(home)
    try:
        envs = xavier_envs()
        assert server.launch(launch_body(tiny_model_dir, envs)) == {"model_uid": MODEL}
        # our hook classes did the work (upstream's would not log these)
        registered = log_lines(home, "xavier.collective_manager")
        assert sum(f"rank {r} registered at" in line for line in registered
                   for r in (0, 1, 2)) == 3
        attached = log_lines(home, "init_xavier: workers attached=True")
        assert len(attached) == 2
        addresses = {}
        for line in log_lines(home, "registered at"):
            rank = int(line.split("rank ")[1].split()[0])
            addresses[rank] = line.strip().rsplit(" ", 1)[1]

        text = open(os.__file__).read()
        prefix = text[:2500]
        usages = [server.call("POST", "/v1/completions", {
            "model": MODEL, "prompt": prefix + f"\n# request {i}\n" + text[7000 + 100 * i:
                                                                          7100 + 100 * i],
            "max_tokens": 8, "temperature": 0})["usage"] for i in range(2)]
        assert all(u["completion_tokens"] > 0 for u in usages)
        c = {r: asyncio.run(counters(addresses[r], r)) for r in (1, 2)}
        print("xavier counters per rank:", {r: {k: c[r].get(k, 0) for k in (
            "requests_with_hits", "hit_blocks", "hit_tokens", "batch_calls", "blocks_written",
            "export_exported", "rows_from_gpu_tier", "rows_from_cpu_tier", "load_failures")}
            for r in (1, 2)}, "usages:", usages)
        # Xinference sent the two requests to different replicas: the second one loaded
        # the shared prefix the first one computed
        assert sum(c[r].get("requests_with_hits", 0) for r in (1, 2)) == 1
        assert sum(c[r].get("hit_blocks", 0) for r in (1, 2)) >= 2500 // 4 // 16
        assert sum(c[r].get("batch_calls", 0) for r in (1, 2)) == 1
        assert sum(c[r].get("load_failures", 0) for r in (1, 2)) == 0

        # the same counters on the worker's metrics endpoint, per replica (sent every 5 s)
        endpoint = metrics_endpoint(home)
        series = wait_for_series(endpoint, "xinference:xavier_hit_blocks_total", 2, 30)
        print("worker metrics:", endpoint, series)
        assert sorted(labels["replica"] for labels, _ in series) == ["0", "1"]
        assert {labels["model"] for labels, _ in series} == {MODEL}
        hit_blocks = {int(labels["replica"]) + 1: value for labels, value in series}
        assert hit_blocks == {r: c[r].get("hit_blocks", 0) for r in (1, 2)}

        assert server.call("DELETE", f"/v1/models/{MODEL}") is None
        deadline = time.monotonic() + 60
        while server.engine_cores() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.engine_cores() == []
        assert server.call("GET", "/v1/models")["data"] == []
        # a terminated model's series are gone from the worker's metrics
        assert scrape(endpoint, "xinference:xavier_hit_blocks_total") == []

        # a bad option fails the launch and names it; nothing stays behind
        bad = dict(envs, XAVIER_CPU_BUDGET="lots")
        with pytest.raises(urllib.error.HTTPError) as err:
            server.call("POST", "/v1/models", launch_body(tiny_model_dir, bad))
        detail = json.loads(err.value.read())["detail"]
        assert "xavier_cpu_budget: 'lots' is not a size" in detail
        assert server.call("GET", "/v1/models")["data"] == []
        time.sleep(2)
        assert server.engine_cores() == []

        # checked in the supervisor before any engine starts (the overlay's wrapper of
        # launch_builtin_model): the CLI's spelling, a strict switch, replicas, env names
        fast = {
            "enable_xavier: expected true or false, got 'maybe'": {"enable_xavier": "maybe"},
            "enable_xavier: expected true or false, got 'sure'": {"enable-xavier": "sure"},
            "enable_xavier: shares prefixes between replicas and needs replica >= 2": {
                "replica": 1},
            "XAVIER_CPU_BUGDET: unknown Xavier setting; did you mean XAVIER_CPU_BUDGET?": {
                "envs": {"XAVIER_CPU_BUGDET": "64MiB"}},
        }
        for message, change in fast.items():
            body = launch_body(tiny_model_dir, envs)
            if "enable-xavier" in change:
                body.pop("enable_xavier")
            body.update(change)
            t0 = time.monotonic()
            with pytest.raises(urllib.error.HTTPError) as err:
                server.call("POST", "/v1/models", body)
            print(f"refused in {time.monotonic() - t0:.2f} s: {message}")
            assert message in json.loads(err.value.read())["detail"]
        assert server.call("GET", "/v1/models")["data"] == []
        assert server.engine_cores() == []

        # the CLI, with the card's spelling: a refused option exits non-zero at once, with
        # the message (a launch that fails later still exits 0: upstream's CLI, see the
        # user guide)
        refused = cli_launch(server, tiny_model_dir, "--enable-xavier", "maybe")
        assert refused.returncode != 0
        assert "enable_xavier: expected true or false, got 'maybe'" in refused.stderr
        assert server.call("GET", "/v1/models")["data"] == []
    finally:
        server.stop()
