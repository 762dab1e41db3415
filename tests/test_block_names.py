import hashlib

from xinference.model.llm.vllm.xavier.planning.block_names import (
    NAME_BITS,
    block_name,
    row_key,
)


def test_block_name_is_stable_wide_and_content_bound():
    assert block_name(b"abc") == block_name(bytearray(b"abc")) == block_name(memoryview(b"abc"))
    assert block_name(b"abc") != block_name(b"abd")
    assert block_name(12345) == block_name(12345)
    for v in (b"", 0, -5, 2**200, ("x", 1)):
        assert 0 <= block_name(v) < 2**NAME_BITS
    # the full 32-byte hash vLLM gives (sha256) is digested whole: names differing only
    # in the last byte differ
    h = hashlib.sha256(b"block").digest()
    assert block_name(h) != block_name(h[:-1] + bytes([h[-1] ^ 1]))
    assert NAME_BITS >= 128  # a name is at least 128 bits beyond any int64 key (#23)


def test_row_key_is_the_low_63_bits():
    name = block_name(b"abc")
    assert row_key(name) == name & (2**63 - 1) and 0 <= row_key(name) < 2**63
    forged = (row_key(name)) | (7 << 100)  # another name with the same low bits
    assert forged != name and row_key(forged) == row_key(name)
