"""vLLM's block hashes agree across a launch's replicas only with a shared seed; the seed
is the launch's secret (#23), applied in the engine core without touching the process
environment."""

import os
import subprocess
import sys

import pytest

from xinference.model.llm.vllm.xavier.planning.hash_seed import new_launch_seed, user_seed

# plays vLLM's EngineCore.__init__: the connector's scheduler half is built (here: the
# seed is handed over; vLLM imports it by the package's installed name, engine.CONNECTOR_MODULE),
# then vLLM calls init_none_hash through its core module
HASHES = r"""
import os, sys
mode, seed = sys.argv[1], sys.argv[2]
if mode == "xavier":
    from _xinference_xavier_fork.vllm_side import none_hash
    assert none_hash.seed_next_init(seed)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
from vllm.v1.engine import core
fn = get_hash_fn_by_name("sha256")
core.init_none_hash(fn)
parent = None
for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
    parent = k.hash_block_tokens(fn, parent, block)
print("HASH", bytes(parent).hex())
if mode == "xavier":
    print("SEEDED", none_hash.seeded_with(seed), none_hash.seeded_with(seed + "0"))
    print("UNWRAPPED", core.init_none_hash is k.init_none_hash)
print("ENV", os.environ.get("PYTHONHASHSEED"), sys.flags.hash_randomization)
"""


def run_engine_core_start(mode: str, seed: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", HASHES, mode, seed], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in proc.stdout.splitlines()
            if ln.split(" ", 1)[0] in ("HASH", "SEEDED", "UNWRAPPED", "ENV")}


def test_one_launch_seed_agrees_another_differs_and_the_environment_is_untouched():
    seed, other = new_launch_seed(), new_launch_seed()
    first, again = run_engine_core_start("xavier", seed), run_engine_core_start("xavier", seed)
    assert first["HASH"] == again["HASH"]  # two replicas of one launch
    assert run_engine_core_start("xavier", other)["HASH"] != first["HASH"]  # another launch
    assert first["SEEDED"] == "True False" and first["UNWRAPPED"] == "True"
    # the seed never entered the environment; Python's hash randomization stays on
    assert first["ENV"] == "None 1"
    # negative control: vLLM's default (no seed) differs between processes
    assert run_engine_core_start("plain")["HASH"] != run_engine_core_start("plain")["HASH"]


def test_launch_seeds_are_fresh_secrets():
    seeds = {new_launch_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(len(s) == 64 and int(s, 16) >= 0 for s in seeds)


def test_user_seed():
    assert user_seed({}) is None and user_seed({"PYTHONHASHSEED": ""}) is None
    assert user_seed({"PYTHONHASHSEED": "42"}) == "42"
    with pytest.raises(ValueError, match="^PYTHONHASHSEED: 'random'"):
        user_seed({"PYTHONHASHSEED": "random"})
