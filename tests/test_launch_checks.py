"""Xavier's launch options as the supervisor sees them (pure), and the overlay's wrapper of
the real ``SupervisorActor.launch_builtin_model`` (fresh interpreters, overlay on and off)."""

import os
import subprocess
import sys

import pytest

from xinference.model.llm.vllm.xavier.planning.launch_checks import (
    asks_for_xavier,
    error_text,
    normalize_launch,
)
from xinference.model.llm.vllm.xavier.planning.options import parse_switch


@pytest.mark.parametrize("value, on", [
    (True, True), (False, False), (1, True), (0, False), ("true", True), ("False", False),
    ("yes", True), ("no", False), (" ON ", True), ("off", False)])
def test_switch_values(value, on):
    assert parse_switch("enable_xavier", value) is on


@pytest.mark.parametrize("value", ["maybe", 2, None, [True]])
def test_other_switch_values_fail_naming_the_option(value):
    with pytest.raises(ValueError, match="^enable_xavier: expected true or false"):
        parse_switch("enable_xavier", value)


def test_the_cli_spelling_and_the_strict_switch():
    kwargs = {"enable-xavier": "true", "vllm-transfer-backend-type": "ipc", "other-key": 1}
    normalize_launch(kwargs, 2, {"XAVIER_CPU_BUDGET": "1GiB"})
    assert kwargs == {"enable_xavier": True, "vllm_transfer_backend_type": "ipc",
                      "other-key": 1,  # only Xavier's own keys are renamed
                      "xavier_routing": "cache_aware"}  # (the default: the supervisor's)
    off = {"enable_xavier": "false"}
    normalize_launch(off, 1, {"XAVIER_CPU_BUGDET": "x"})  # off: nothing else is checked
    assert off == {"enable_xavier": False}
    untouched = {"foo": "bar"}
    normalize_launch(untouched, 1, None)
    assert untouched == {"foo": "bar"}
    # tensor parallelism is shared shard by shard; parallel sizes without Xavier: vLLM's
    normalize_launch({"enable_xavier": True, "tensor_parallel_size": 1}, 2, None)
    normalize_launch({"enable_xavier": True, "tensor_parallel_size": 2}, 2, None)
    normalize_launch({"enable_xavier": True, "tensor-parallel-size": "4"}, 2, None)
    normalize_launch({"pipeline_parallel_size": 4}, 2, None)
    normalize_launch({"enable_xavier": True, "data_parallel_size": 1}, 2, None)
    normalize_launch({"data_parallel_size": 2}, 2, None)
    # vLLM's cryptographic prefix hashes name shared blocks; xxhash without Xavier: vLLM's
    for algo in ("sha256", "sha256_cbor"):
        normalize_launch({"enable_xavier": True, "prefix_caching_hash_algo": algo}, 2, None)
    normalize_launch({"prefix_caching_hash_algo": "xxhash"}, 2, None)


@pytest.mark.parametrize("kwargs, replica, envs, message", [
    ({"enable_xavier": True}, 1, None, "^enable_xavier: .* needs replica >= 2, got replica=1"),
    ({"enable_xavier": True, "enable-xavier": True}, 2, None, "^enable_xavier: given twice"),
    ({"enable_xavier": "true"}, 2, {"XAVIER_CPU_BUGDET": "1GiB"},
     "^XAVIER_CPU_BUGDET: unknown Xavier setting; did you mean XAVIER_CPU_BUDGET"),
    ({"enable_xavier": "true"}, 2, {"XAVIER_GPU_BUDGET": "lots"},
     "^xavier_gpu_budget: 'lots' is not a size"),
    ({"enable_xavier": "true"}, 2, {"XAVIER_SWITCH_INTERVAL_US": "5ms"},
     "^xavier_switch_interval_us: expected whole microseconds"),
    ({"enable_xavier": "true"}, 2, {"XAVIER_LOAD_POLICY": "never"},
     "^xavier_load_policy: expected one of cost, always, got 'never'"),
    ({"enable_xavier": "true"}, 2, {"XAVIER_ROOM_COPY_PROGRAMS": "-1"},
     r"^XAVIER_ROOM_COPY_PROGRAMS: expected a whole number >= 0 \(0: the full grid\), "
     "got '-1'"),
    ({"enable_xavier": True, "pipeline_parallel_size": 2}, 2, None,
     "^pipeline_parallel_size: Xavier does not share the KV of pipeline-parallel replicas "
     ".* got pipeline_parallel_size=2"),
    ({"enable_xavier": True, "pipeline-parallel-size": "2"}, 2, None,
     "^pipeline_parallel_size: .* got pipeline_parallel_size='2'"),
    ({"enable_xavier": True, "data_parallel_size": 2}, 2, None,
     "^data_parallel_size: Xavier does not share the KV of data-parallel replicas "
     r"\(tensor parallelism is supported\), got data_parallel_size=2; launch with "
     "data_parallel_size=1 or without enable_xavier"),
    ({"enable_xavier": True, "data-parallel-size": "4"}, 2, None,
     "^data_parallel_size: .* got data_parallel_size='4'"),
    ({"enable_xavier": True, "prefix_caching_hash_algo": "xxhash"}, 2, None,
     "^prefix_caching_hash_algo: .* must be collision resistant .* got 'xxhash'"),
    ({"enable_xavier": True, "prefix-caching-hash-algo": "xxhash_cbor"}, 2, None,
     "^prefix_caching_hash_algo: .* got 'xxhash_cbor'")])
def test_bad_launches_fail_naming_the_option(kwargs, replica, envs, message):
    with pytest.raises(ValueError, match=message):
        normalize_launch(dict(kwargs), replica, envs)


def test_which_launches_ask_for_xavier():
    assert asks_for_xavier({"enable-xavier": "true"}) and asks_for_xavier({"enable_xavier": 1})
    assert not asks_for_xavier({"enable_xavier": "false"}) and not asks_for_xavier({})
    assert not asks_for_xavier({"enable-xavier": "maybe"})  # refused by the supervisor


CHECK = r"""
import asyncio, sys
import xinference.core.supervisor as s
method = s.SupervisorActor.launch_builtin_model
print("PATCHED", getattr(method, "_xavier_overlay", False))
import xinference.deploy.cmdline as c
print("CLI", getattr(c.model_launch.callback, "_xavier_overlay", False))
if "--call" in sys.argv:
    try:
        asyncio.run(method(object(), None, "m", None, None, None, "vllm", "LLM", replica=2,
                           **{"enable-xavier": "maybe"}))
    except ValueError as exc:
        print("ERROR", exc)
"""


def run_check(*args, overlay="1"):
    env = dict(os.environ, XINFERENCE_XAVIER_OVERLAY=overlay)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", CHECK, *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_overlay_wraps_the_supervisors_launch_and_checks_first():
    out = run_check("--call")
    assert "PATCHED True" in out and "CLI True" in out
    assert "ERROR enable_xavier: expected true or false, got 'maybe'" in out


def test_without_the_overlay_the_launch_is_upstreams():
    out = run_check(overlay="0")
    assert "PATCHED False" in out and "CLI False" in out


def test_error_text_starts_with_the_option_name():
    """The texts a late launch failure arrived in (vLLM's two collective_rpc wrappers,
    xoscar's address prefixes, the client's prefix) all give the option's message."""
    for message in ("Call to collective_rpc method failed: [address=a:1, pid=2] "
                    "xavier_cpu_budget: x",
                    "Worker failed with error '[address=a:1, pid=2] xavier_cpu_budget: x', see",
                    "Failed to launch model, detail: [address=b:1, pid=3] Call to collective_rpc"
                    " method failed: [address=a:1, pid=2] xavier_cpu_budget: x"):
        assert error_text(message) == "xavier_cpu_budget: x"
    assert error_text("plain") == "plain"


def test_the_routing_option_in_either_spelling_and_its_refusals():
    """``xavier_routing`` (#37): parsed for a Xavier launch (the supervisor keeps it), a bad
    value named, and refused without Xavier (the model would get it as a vLLM argument)."""
    kwargs = {"enable_xavier": True, "xavier-routing": "Round-Robin"}
    normalize_launch(kwargs, 2, None)
    assert kwargs == {"enable_xavier": True, "xavier_routing": "round_robin"}
    with pytest.raises(ValueError, match="^xavier_routing: expected one of cache_aware, "
                                         "round_robin, got 'nearest'"):
        normalize_launch({"enable_xavier": True, "xavier_routing": "nearest"}, 2, None)
    for off in ({"xavier_routing": "round_robin"},
                {"enable_xavier": "false", "xavier_routing": "round_robin"}):
        with pytest.raises(ValueError, match="^xavier_routing: routes the replicas of a "
                                             "Xavier launch"):
            normalize_launch(off, 2, None)
