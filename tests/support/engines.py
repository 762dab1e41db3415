"""Real vLLM V1 engines on the tiny model, in a child process.

CPU settings used everywhere: ``VLLM_CPU_KVCACHE_SPACE`` small (1 GiB by
default, ``XAVIER_TEST_KV_GIB`` overrides), eager mode, bf16, prefix caching,
block size 16.  vLLM's CPU platform uses ``spawn``; child processes get this
repository on ``PYTHONPATH`` so the overlay and the test support import there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def replica_cores(n: int) -> List[str]:
    """Each of ``n`` replicas of vLLM's CPU build its own share of this process's cores (its
    ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0,1"``): one logical CPU per physical core (the
    highest-numbered sibling, as vLLM's own binding picks on x86), split evenly; with
    fewer cores than replicas, round robin over them (shared).  vLLM's own binding
    ("auto") knows nothing of the other engines on the host and gives each the same cores:
    on a 2-core machine both replicas of a pair ran their forwards (and started) on core 0,
    while a pair with a KV connector that vLLM does not know (one core more reserved)
    spread over both -- a no-op connector served 1.37x plain vLLM's tokens/s that way
    (session 43)."""
    per_core: Dict[str, int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list") as f:
                core = f.read().strip()
        except OSError:
            core = str(cpu)
        per_core[core] = cpu  # (the last sibling)
    cores = sorted(per_core.values())
    if len(cores) < n:
        return [str(cores[i % len(cores)]) for i in range(n)]
    k = len(cores) // n
    return [",".join(str(c) for c in cores[i * k:(i + 1) * k]) for i in range(n)]


def cpu_engine_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("XAVIER_TEST_KV_GIB", "1"),
        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        # the data plane's test hooks (faults, digests): tests only, never in production
        "XAVIER_TEST_HOOKS": "tests.support.worker_hooks:WorkerHooks",
    }
    env.update(extra or {})
    return env


@dataclass
class EngineOptions:
    model: str
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    def llm_kwargs(self) -> Dict[str, Any]:
        kw: Dict[str, Any] = dict(
            model=self.model, tokenizer=self.model, dtype="bfloat16", enforce_eager=True,
            block_size=self.block_size, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed)
        kw.update(self.extra)
        return kw


class EngineProcess:
    """A vLLM engine in a child process, driven by JSON lines over stdin/stdout.

    ``generate(prompts)`` returns token ids and the number of locally cached
    prompt tokens per request.
    """

    def __init__(self, opts: EngineOptions, env: Optional[Dict[str, str]] = None,
                 start_timeout: float = 300.0) -> None:
        child_env = dict(os.environ)
        child_env.update(cpu_engine_env(env))
        if child_env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            from . import run_table

            run_table.count_in_process_engine()  # no engine-core process to be seen
        child_env["PYTHONPATH"] = REPO + os.pathsep + child_env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.engine_server", json.dumps(opts.llm_kwargs())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
            cwd=REPO, env=child_env, start_new_session=True)
        t0 = time.monotonic()
        ready = self._read(start_timeout)
        if ready.get("status") != "ready":
            self.close()
            raise RuntimeError(f"engine process failed to start: {ready}")
        self.pid = ready["pid"]
        self.start_seconds = time.monotonic() - t0

    def _read(self, timeout: float) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process exited with {self.proc.poll()}")
        return json.loads(line)

    def request(self, message: Dict[str, Any], timeout: float = 300.0) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if "error" in reply:
            raise RuntimeError(f"engine process: {reply['error']}")
        return reply

    def generate(self, prompts: Sequence[Any], max_tokens: int = 16) -> Dict[str, Any]:
        return self.request({"op": "generate", "prompts": list(prompts),
                             "max_tokens": max_tokens})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                pass
        if self.proc.poll() is None:
            import signal

            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
