"""Xavier's options: sources, validation with the option's name, trip through vLLM's config."""

import pytest

from xinference.model.llm.vllm.xavier.planning.launch_checks import normalize_launch
from xinference.model.llm.vllm.xavier.planning.options import XavierOptions

BASE = {"rank": 1, "rank_address": "127.0.0.1:1", "block_tracker_address": "127.0.0.1:2",
        "block_tracker_uid": b"vllm-block-tracker-actor-m", "vllm_transfer_backend_type": None}


def test_defaults_environment_and_config_in_that_order():
    o = XavierOptions.from_xavier_config(BASE, {})
    assert o.gpu_budget_bytes == 2**30 and o.cpu_budget_bytes == 2**30
    assert o.block_tracker_uid == "vllm-block-tracker-actor-m"
    assert o.transfer_actor_uid == "vllm-transfer-actor-1" and o.transport == "xavier"
    assert o.slab_blocks == 512
    assert XavierOptions.from_xavier_config({**BASE, "transfer_block_num": 64}, {}).slab_blocks \
        == 64
    o = XavierOptions.from_xavier_config(BASE, {"XAVIER_GPU_BUDGET": "256MiB"})
    assert o.gpu_budget_bytes == 256 * 2**20
    o = XavierOptions.from_xavier_config({**BASE, "xavier_gpu_budget": "1KiB"},
                                         {"XAVIER_GPU_BUDGET": "256MiB"})
    assert o.gpu_budget_bytes == 1024


@pytest.mark.parametrize("key,value,message", [
    ("xavier_gpu_budget", "lots", "xavier_gpu_budget: 'lots'"),
    ("xavier_cpu_budget", "-1GiB", "xavier_cpu_budget"),
    ("xavier_cpu_budget", "3 parsecs", "xavier_cpu_budget: unknown unit"),
    ("rank", -1, "rank must be a non-negative int"),
    ("rank_address", "", "missing 'rank_address'"),
    ("vllm_transfer_backend_type", "carrier-pigeon", "transfer"),
    ("transfer_block_num", 0, "xavier_transfer_block_num: must be a positive int"),
    ("xavier_switch_interval_us", "fast", "xavier_switch_interval_us: expected whole"),
    ("xavier_switch_interval_us", -5, "xavier_switch_interval_us: expected whole"),
    ("xavier_switch_interval_us", True, "xavier_switch_interval_us: expected whole"),
])
def test_bad_values_name_the_option(key, value, message):
    with pytest.raises(ValueError, match=message):
        XavierOptions.from_xavier_config({**BASE, key: value}, {})


def test_both_tiers_off_is_refused():
    with pytest.raises(ValueError, match="both storage tiers"):
        XavierOptions.from_xavier_config(
            {**BASE, "xavier_gpu_budget": 0, "xavier_cpu_budget": "0"}, {})


def test_round_trip_through_kv_connector_extra_config():
    o = XavierOptions.from_xavier_config(BASE, {})
    assert XavierOptions.from_extra_config(o.to_extra_config()) == o
    with pytest.raises(ValueError, match="kv_connector_extra_config"):
        XavierOptions.from_extra_config({})
    with pytest.raises(ValueError, match="kv_connector_extra_config.xavier"):
        XavierOptions.from_extra_config({"xavier": {"rank": 1}})


def test_switch_interval_default_environment_and_config():
    """Xavier's GIL switch interval for vLLM's engine processes: 500 µs by default, 0 keeps
    Python's (the connector then leaves it alone)."""
    assert XavierOptions.from_xavier_config(BASE, {}).switch_interval_us == 500
    env = {"XAVIER_SWITCH_INTERVAL_US": "0"}
    assert XavierOptions.from_xavier_config(BASE, env).switch_interval_us == 0
    o = XavierOptions.from_xavier_config({**BASE, "xavier_switch_interval_us": 250}, env)
    assert o.switch_interval_us == 250


def test_batched_loads_switch():
    assert XavierOptions.from_xavier_config(BASE, {}).batched_loads is True
    assert XavierOptions.from_xavier_config(BASE, {"XAVIER_BATCHED_LOADS": "0"}).batched_loads \
        is False
    with pytest.raises(ValueError, match="xavier_batched_loads: expected true or false"):
        XavierOptions.from_xavier_config({**BASE, "xavier_batched_loads": "sometimes"}, {})


def test_load_policy_default_environment_config_and_a_refused_value():
    """``xavier_load_policy``: cost (a hit is loaded only when it pays) unless asked to
    load every hit; a value that is neither fails naming the option."""
    assert XavierOptions.from_xavier_config(BASE, {}).load_policy == "cost"
    env = {"XAVIER_LOAD_POLICY": "Always"}
    assert XavierOptions.from_xavier_config(BASE, env).load_policy == "always"
    o = XavierOptions.from_xavier_config({**BASE, "xavier_load_policy": "cost"}, env)
    assert o.load_policy == "cost"
    with pytest.raises(ValueError, match="^xavier_load_policy: expected one of cost, always, "
                                         "got 'sometimes'"):
        XavierOptions.from_xavier_config(BASE, {"XAVIER_LOAD_POLICY": "sometimes"})


def test_save_victims_default_environment_config_switches_and_a_refused_value():
    """``xavier_save_victims``: shared unless asked for all or off; a switch's true means
    all and false off (the option's spelling before ``shared``); anything else fails
    naming the option -- at launch too, before any engine starts."""
    assert XavierOptions.from_xavier_config(BASE, {}).save_victims == "shared"
    for value, policy in (("ALL", "all"), ("off", "off"), ("1", "all"), ("false", "off"),
                          ("Shared", "shared")):
        env = {"XAVIER_SAVE_VICTIMS": value}
        assert XavierOptions.from_xavier_config(BASE, env).save_victims == policy, value
    o = XavierOptions.from_xavier_config({**BASE, "xavier_save_victims": True},
                                         {"XAVIER_SAVE_VICTIMS": "off"})
    assert o.save_victims == "all"
    message = "^xavier_save_victims: expected one of shared, all, off .*got 'some'"
    with pytest.raises(ValueError, match=message):
        XavierOptions.from_xavier_config(BASE, {"XAVIER_SAVE_VICTIMS": "some"})
    with pytest.raises(ValueError, match=message):
        normalize_launch({"enable_xavier": True}, 2, {"XAVIER_SAVE_VICTIMS": "some"})


def test_host_index_default_environment_config_and_a_refused_value():
    """``xavier_host_index``: on unless switched off (environment, then the launch's
    config); a value that is not a switch fails naming the option."""
    assert XavierOptions.from_xavier_config(BASE, {}).host_index is True
    env = {"XAVIER_HOST_INDEX": "0"}
    assert XavierOptions.from_xavier_config(BASE, env).host_index is False
    assert XavierOptions.from_xavier_config({**BASE, "xavier_host_index": True}, env).host_index
    with pytest.raises(ValueError, match="^xavier_host_index: expected true or false"):
        XavierOptions.from_xavier_config(BASE, {"XAVIER_HOST_INDEX": "maybe"})


@pytest.mark.parametrize("name, hint", [
    ("XAVIER_CPU_BUGDET", "did you mean XAVIER_CPU_BUDGET?"),
    ("XAVIER_GPU_BUDGE", "did you mean XAVIER_GPU_BUDGET?"),
    ("XAVIER_QUUXQUUXQUUX", "known: XAVIER_GPU_BUDGET, XAVIER_CPU_BUDGET")])
def test_a_misspelled_setting_fails_naming_the_closest_known_one(name, hint):
    base = {"rank": 1, "rank_address": "a", "block_tracker_address": "b",
            "block_tracker_uid": "t"}
    with pytest.raises(ValueError, match=rf"^{name}: unknown Xavier setting; {hint}"):
        XavierOptions.from_xavier_config(base, {name: "8GiB"})
    # known names, the test tooling's and other programs' variables pass
    env = {"XAVIER_CPU_BUDGET": "8GiB", "XAVIER_TEST_DEVICE": "cpu",
           "XAVIER_TINY_MODEL_DIR": "/m", "XINFERENCE_XAVIER_OVERLAY": "1", "HOME": "/root"}
    assert XavierOptions.from_xavier_config(base, env).cpu_budget_bytes == 8 << 30


def test_every_xavier_variable_the_package_reads_is_a_known_setting():
    """A variable the package reads but the launch check does not know would fail every
    launch that sets it (``XAVIER_UVA`` nearly did)."""
    import pathlib
    import re

    from xinference.model.llm.vllm.xavier.planning.options import KNOWN_ENV, TOOLING_ENV

    package = pathlib.Path(__file__).resolve().parents[1] / "xinference/model/llm/vllm/xavier"
    read = {m for f in package.rglob("*.py")
            for m in re.findall(r"\"(XAVIER_[A-Z_]*[A-Z])\"", f.read_text())}
    assert {"XAVIER_GPU_BUDGET", "XAVIER_UVA"} <= read  # the scan sees the package
    unknown = {n for n in read if n not in KNOWN_ENV + TOOLING_ENV
               and not n.startswith("XAVIER_TEST_")}
    assert not unknown, unknown


def test_every_xavier_variable_the_tooling_sets_is_a_known_name():
    """The GPU and CPU scripts and the benchmarks pass their own ``XAVIER_*`` settings in
    the environment, which the replicas they start inherit: a name the launch check does not
    know fails every such replica (``XAVIER_CHAT_USERS`` did, on the H200)."""
    import pathlib
    import re

    from xinference.model.llm.vllm.xavier.planning.options import KNOWN_ENV, TOOLING_ENV

    root = pathlib.Path(__file__).resolve().parents[1]
    files = [*root.glob("scripts/*.sh"), *root.glob("benchmarks/*.py"), root / ".ci/run"]
    used = {m for f in files if f.is_file()
            for m in re.findall(r"\b(XAVIER_[A-Z0-9_]*[A-Z0-9])\b", f.read_text())}
    assert {"XAVIER_BENCH_MODES", "XAVIER_CHAT_USERS"} <= used  # the scan sees the scripts
    unknown = {n for n in used if n not in KNOWN_ENV + TOOLING_ENV
               and not n.startswith("XAVIER_TEST_")}
    assert not unknown, unknown


def test_the_room_threads_demotion_blocks_default_and_diagnostic_setting():
    from xinference.model.llm.vllm.xavier.planning.options import (
        ROOM_COPY_PROGRAMS,
        room_copy_programs,
    )

    assert room_copy_programs({}) == ROOM_COPY_PROGRAMS == 4
    assert room_copy_programs({"XAVIER_ROOM_COPY_PROGRAMS": " 16 "}) == 16
    assert room_copy_programs({"XAVIER_ROOM_COPY_PROGRAMS": "0"}) is None  # the full grid
    with pytest.raises(ValueError, match="^XAVIER_ROOM_COPY_PROGRAMS: .* got 'four'"):
        room_copy_programs({"XAVIER_ROOM_COPY_PROGRAMS": "four"})
