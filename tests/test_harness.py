"""The test harness itself: tiny model, real vLLM CPU engines, real xoscar pools."""

import asyncio
import json
import os

import xoscar as xo

from .support.pools import actor_pool, sub_pool_addresses
from .support.probe_actor import OverlayProbeActor
from .support.tiny_model import TinyQwen2, build_tiny_qwen2


def test_tiny_model_is_deterministic(tmp_path, tiny_model_dir):
    again = build_tiny_qwen2(str(tmp_path / "again"), TinyQwen2())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        with open(os.path.join(tiny_model_dir, name), "rb") as a, \
                open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name
    conf = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    assert conf["num_key_value_heads"] == 2 and conf["num_hidden_layers"] == 4


def test_engine_in_child_process_generates_and_caches_prefixes(engine_process):
    prompt = "def fibonacci(n):\n    " * 12
    first = engine_process.generate([prompt], max_tokens=16)
    second = engine_process.generate([prompt], max_tokens=16)
    assert engine_process.pid != os.getpid()
    assert len(first["ids"][0]) == 16 and first["ids"] == second["ids"]
    assert first["prompt_len"][0] > 32
    # block size 16: the second pass finds every full block of the prompt cached
    assert second["cached"][0] == (first["prompt_len"][0] - 1) // 16 * 16 > first["cached"][0]


def test_actor_pool_has_separate_sub_processes():
    async def run():
        async with actor_pool(n_process=2) as pool:
            pids = []
            for i, addr in enumerate(sub_pool_addresses(pool)):
                ref = await xo.create_actor(OverlayProbeActor, address=addr, uid=f"p{i}")
                pids.append((await ref.where())["pid"])
            return pids

    pids = asyncio.run(run())
    assert len(set(pids)) == 2 and os.getpid() not in pids
