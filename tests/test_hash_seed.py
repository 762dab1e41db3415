"""vLLM's block hashes agree across processes only with a shared seed."""

import os
import subprocess
import sys

import pytest

from xinference.model.llm.vllm.xavier.planning.hash_seed import (
    DEFAULT_SEED,
    ensure_shared_hash_seed,
)

HASHES = r"""
import os, sys
if sys.argv[1] == "xavier":
    from xinference.model.llm.vllm.xavier.planning.hash_seed import ensure_shared_hash_seed
    ensure_shared_hash_seed()
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
fn = get_hash_fn_by_name("sha256")
k.init_none_hash(fn)
parent = None
for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
    parent = k.hash_block_tokens(fn, parent, block)
print("HASH", bytes(parent).hex())
"""


def block_hash_in_fresh_process(mode):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", HASHES, mode], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("HASH ")][-1]


def test_two_processes_agree_with_the_shared_seed_and_not_without():
    assert block_hash_in_fresh_process("xavier") == block_hash_in_fresh_process("xavier")
    # negative control: vLLM's default (no seed) differs between processes
    assert block_hash_in_fresh_process("plain") != block_hash_in_fresh_process("plain")


def test_ensure_shared_hash_seed():
    env = {}
    assert ensure_shared_hash_seed(env) == DEFAULT_SEED and env["PYTHONHASHSEED"] == "0"
    assert ensure_shared_hash_seed({"PYTHONHASHSEED": "42"}) == "42"
    with pytest.raises(ValueError, match="^PYTHONHASHSEED: 'random'"):
        ensure_shared_hash_seed({"PYTHONHASHSEED": "random"})
