"""XavierEngine.from_engine_args' preparation of vLLM's engine arguments (no engine started;
the local tiny model keeps vLLM from looking anything up)."""

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from xinference.model.llm.vllm.xavier.engine import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    WORKER_EXTENSION,
    prepare_engine_args,
)
from xinference.model.llm.vllm.xavier.planning.options import XavierOptions


@pytest.fixture
def model(tiny_model_dir: str) -> str:
    return tiny_model_dir


CFG = {"rank": 2, "rank_address": "127.0.0.1:1", "block_tracker_address": "127.0.0.1:2",
       "block_tracker_uid": "t", "world_size": 3, "vllm_transfer_backend_type": None}


def test_kv_transfer_config_seed_and_scheduling(model):
    args = AsyncEngineArgs(model=model)
    env: dict = {}
    opts = prepare_engine_args(args, dict(CFG, xavier_cpu_budget="64MiB"), env)
    ktc = args.kv_transfer_config
    assert ktc.kv_connector == "XavierConnector"
    assert ktc.kv_connector_module_path == CONNECTOR_MODULE
    assert ktc.kv_role == "kv_both" and ktc.kv_load_failure_policy == "recompute"
    assert XavierOptions.from_extra_config(ktc.kv_connector_extra_config) == opts
    assert opts.cpu_budget_bytes == 64 * 2**20
    # no public seed: the engine core seeds block hashes with the launch's secret (#23)
    assert "PYTHONHASHSEED" not in env and env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # vLLM's CPU build on x86 (CI's): the cores reserved as with no KV connector
    from vllm.platforms import CpuArchEnum, current_platform

    cpu_x86 = (current_platform.is_cpu()
               and current_platform.get_cpu_architecture() == CpuArchEnum.X86)
    assert env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") == ("1" if cpu_x86 else None)
    # vLLM's own speed settings are left alone: async scheduling as vLLM decides (None:
    # on where it applies), the model runner vLLM picks
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env
    assert args.enable_prefix_caching is True and args.async_scheduling is None
    assert args.worker_extension_cls == WORKER_EXTENSION


def test_conflicting_or_bad_settings_fail_naming_the_option(model):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        prepare_engine_args(AsyncEngineArgs(model=model, enable_prefix_caching=False), CFG, {})
    args = AsyncEngineArgs(model=model, kv_transfer_config={"kv_connector": "NixlConnector",
                                                          "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_transfer_config"):
        prepare_engine_args(args, CFG, {})
    with pytest.raises(ValueError, match="xavier_gpu_budget"):
        prepare_engine_args(AsyncEngineArgs(model=model), dict(CFG, xavier_gpu_budget="x"), {})
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        prepare_engine_args(AsyncEngineArgs(model=model), CFG, {"PYTHONHASHSEED": "random"})


def test_user_scheduling_runner_and_worker_extension_are_kept(model):
    for asked, runner in ((True, "1"), (False, "0")):
        args = AsyncEngineArgs(model=model, async_scheduling=asked, worker_extension_cls="my.Ext")
        env = {"VLLM_USE_V2_MODEL_RUNNER": runner}
        prepare_engine_args(args, CFG, env)
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == runner
        assert args.async_scheduling is asked and args.worker_extension_cls == "my.Ext"


def test_gpu_budget_must_fit_next_to_vllm():
    from xinference.model.llm.vllm.xavier.engine import check_gpu_budget

    gib = 2**30
    opts = XavierOptions.from_xavier_config(dict(CFG, xavier_gpu_budget="8GiB"), {})
    check_gpu_budget(opts, 0.5, mem_get_info=lambda: (100 * gib, 140 * gib))  # 30 GiB left
    with pytest.raises(ValueError, match=r"xavier_gpu_budget: 8589934592 bytes do not fit"):
        check_gpu_budget(opts, 0.9, mem_get_info=lambda: (130 * gib, 140 * gib))
    off = XavierOptions.from_xavier_config(dict(CFG, xavier_gpu_budget=0), {})
    check_gpu_budget(off, 0.99, mem_get_info=lambda: (0, 140 * gib))  # tier off: no check
    # several replicas on one GPU: vLLM's kv_cache_memory_bytes replaces the utilization
    # (whose default 0.9 would refuse any tier here)
    check_gpu_budget(opts, 0.9, mem_get_info=lambda: (130 * gib, 140 * gib),
                     kv_cache_memory_bytes=20 * gib)
    with pytest.raises(ValueError, match=r"8589934592 bytes do not fit.*kv_cache_memory_bytes="
                                         r"134217728000 plus its weights"):
        check_gpu_budget(opts, 0.9, mem_get_info=lambda: (130 * gib, 140 * gib),
                         kv_cache_memory_bytes=125 * gib)


def test_vllm_loads_the_connector_by_the_installed_name():
    """Installed, the connector's module path is the installed name (no upstream
    ``xinference.model`` import in vLLM's engine processes), and it names this very module."""
    import importlib

    from xinference.model.llm.vllm.xavier.vllm_side import connector

    assert CONNECTOR_MODULE == "_xinference_xavier_fork.vllm_side.connector"
    assert importlib.import_module(CONNECTOR_MODULE) is connector


def test_xavier_worker_extension_by_its_public_path_is_xavier_s(model):
    """A user who names Xavier's own worker extension by the public path gets it (loaded by
    the installed name, and ``init_xavier`` still attaches at once)."""
    public = "xinference.model.llm.vllm.xavier.vllm_side.worker_extension.XavierWorkerExtension"
    args = AsyncEngineArgs(model=model, worker_extension_cls=public)
    prepare_engine_args(args, CFG, {})
    assert args.worker_extension_cls == WORKER_EXTENSION != public


def test_the_names_vllm_loads_exist():
    """vLLM imports the connector and the worker extension by these names in its own
    processes: each must resolve (a moved module fails here, not in a replica)."""
    import importlib

    connector = importlib.import_module(CONNECTOR_MODULE)
    assert getattr(connector, CONNECTOR_NAME).__name__ == CONNECTOR_NAME
    module, _, cls = WORKER_EXTENSION.rpartition(".")
    assert hasattr(importlib.import_module(module), cls)


def test_the_cpu_builds_core_reservation_is_vllms_own_unless_nixl_or_the_users():
    """vLLM's CPU build reserves one core more for any KV connector (meant for a NIXL
    connector in its workers): Xavier reserves what vLLM reserves without one, except where
    the user chose, or off the CPU build (NIXL as Xavier's transport runs in the transfer
    actor, not in vLLM's workers: no exception for it)."""
    from xinference.model.llm.vllm.xavier.engine import keep_cpu_core_reservation

    opts = XavierOptions.from_xavier_config(CFG, {})
    env: dict = {}
    assert keep_cpu_core_reservation(opts, env, cpu_x86=True) == "1"
    assert env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    mine = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert keep_cpu_core_reservation(opts, mine, cpu_x86=True) is None and mine == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    nixl = XavierOptions.from_xavier_config(dict(CFG, vllm_transfer_backend_type="nixl"), {})
    assert keep_cpu_core_reservation(nixl, env := {}, cpu_x86=True) == "1"
    assert keep_cpu_core_reservation(opts, env := {}, cpu_x86=False) is None and env == {}
