"""The connector's scheduler half on vLLM's own request objects and block hasher: what
names a request's blocks get (tenants apart: cache salts, LoRA adapters), and which
requests may load (#23)."""

from typing import List, Optional

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import BlockHash, get_request_block_hasher
from vllm.v1.request import Request

from xinference.model.llm.vllm.xavier.vllm_side.connector_scheduler import (
    _key_source,
    reads_prefix_cache,
    sharing_allowed,
)

BS = 16
PROMPT = list(range(1000, 1000 + 4 * BS + 3))


@pytest.fixture(autouse=True)
def seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    # what the engine core holds once the launch's seed is applied (test_hash_seed.py)
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH",
                        BlockHash(get_hash_fn_by_name("sha256")("a launch's seed")), raising=False)


def request(lora: Optional[LoRARequest] = None, salt: Optional[str] = None,
            **sampling: object) -> Request:
    fn = get_hash_fn_by_name("sha256")
    return Request("r", list(PROMPT), SamplingParams(max_tokens=4, **sampling), None,
                   lora_request=lora, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BS, fn))


def names(req: Request) -> List[int]:
    return list(_key_source(req)())


def test_names_keep_salts_and_lora_adapters_apart():
    plain = names(request())
    assert len(plain) == 4 and names(request()) == plain
    a, b = LoRARequest("adapter-a", 1, "/a"), LoRARequest("adapter-b", 2, "/b")
    with_a = names(request(lora=a))
    assert with_a == names(request(lora=LoRARequest("adapter-a", 1, "/a")))
    assert not set(with_a) & set(names(request(lora=b))) and not set(with_a) & set(plain)
    salted = names(request(salt="tenant-a"))
    assert salted == names(request(salt="tenant-a"))
    assert not set(salted) & set(names(request(salt="tenant-b"))) and not set(salted) & set(plain)


def test_prompt_logprob_requests_read_no_prefix_cache_and_may_opt_out():
    assert reads_prefix_cache(request())
    assert not reads_prefix_cache(request(prompt_logprobs=1))  # vLLM skips its cache too
    assert not reads_prefix_cache(request(skip_reading_prefix_cache=True))
    assert sharing_allowed(request())
    assert not sharing_allowed(request(extra_args={"kv_transfer_params": {"xavier": False}}))
