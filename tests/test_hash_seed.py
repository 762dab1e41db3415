"""vLLM's block hashes agree across a launch's replicas only with a shared seed; the seed
is the launch's secret (#23), applied in the engine core without touching the process
environment."""

import os
import subprocess
import sys

import pytest

from xinference.model.llm.vllm.xavier.planning.hash_seed import new_launch_seed, user_seed

# plays vLLM's EngineCore.__init__, once per step given: the connector's scheduler half is
# built (for an "xavier:SEED" step: the seed is handed over; vLLM imports it by the
# package's installed name, engine.CONNECTOR_MODULE), then vLLM calls init_none_hash
# through its core module; a "plain" step is vLLM without a connector.  Several steps share
# one process (an engine core started again in it): each interpreter costs ~13 s of imports
HASHES = r"""
import os, sys
from _xinference_xavier_fork.vllm_side import none_hash
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
from vllm.v1.engine import core
fn = get_hash_fn_by_name("sha256")
for i, step in enumerate(sys.argv[1:]):
    mode, _, seed = step.partition(":")
    if mode == "xavier":
        assert none_hash.seed_next_init(seed)
    core.init_none_hash(fn)
    parent = None
    for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
        parent = k.hash_block_tokens(fn, parent, block)
    print(f"HASH{i}", bytes(parent).hex())
    if mode == "xavier":
        print(f"SEEDED{i}", none_hash.seeded_with(seed), none_hash.seeded_with(seed + "0"))
    print(f"UNWRAPPED{i}", core.init_none_hash is k.init_none_hash)
print("ENV", os.environ.get("PYTHONHASHSEED"), sys.flags.hash_randomization)
"""


def run_engine_core_starts(*steps: str) -> dict:
    """One fresh process (no PYTHONHASHSEED) running ``steps``; what each printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", HASHES, *steps], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(ln.split(" ", 1) for ln in proc.stdout.splitlines()
                if ln.startswith(("HASH", "SEEDED", "UNWRAPPED", "ENV")))


def test_one_launch_seed_agrees_another_differs_and_the_environment_is_untouched():
    """Two processes stand for two replicas.  Each first starts plain (the negative
    control: vLLM's default differs between processes), then with the launch's seed; the
    second one then with another launch's seed."""
    seed, other = new_launch_seed(), new_launch_seed()
    first = run_engine_core_starts("plain", f"xavier:{seed}")
    second = run_engine_core_starts("plain", f"xavier:{seed}", f"xavier:{other}")
    assert first["HASH1"] == second["HASH1"]  # two replicas of one launch
    assert second["HASH2"] != second["HASH1"]  # another launch
    assert first["HASH0"] != second["HASH0"]  # negative control: no seed, no agreement
    assert first["HASH1"] not in (first["HASH0"], second["HASH0"])
    assert first["SEEDED1"] == second["SEEDED1"] == second["SEEDED2"] == "True False"
    assert all(out[f"UNWRAPPED{i}"] == "True" for out in (first, second) for i in range(2))
    # the seed never entered the environment; Python's hash randomization stays on
    assert first["ENV"] == second["ENV"] == "None 1"


def test_launch_seeds_are_fresh_secrets():
    seeds = {new_launch_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(len(s) == 64 and int(s, 16) >= 0 for s in seeds)


def test_user_seed():
    assert user_seed({}) is None and user_seed({"PYTHONHASHSEED": ""}) is None
    assert user_seed({"PYTHONHASHSEED": "42"}) == "42"
    with pytest.raises(ValueError, match="^PYTHONHASHSEED: 'random'"):
        user_seed({"PYTHONHASHSEED": "random"})
