"""How Xavier names a KV block across replicas (pure: the standard library only).

A block's **name** is a 192-bit digest (BLAKE2b) of vLLM's full block hash.  vLLM's hash
chains every token of the prefix, the request's ``cache_salt``, LoRA adapter and
multimodal inputs from ``NONE_HASH``; Xavier never truncates it to something an attacker
could collide: the block directory, the storages and the exports all key blocks by the
full name, so a block is found only under exactly its own name.

The load table is int64 (:mod:`.load_batch`): its ``key`` column carries the name's low
63 bits (:func:`row_key`).  Two different names with equal low bits must never meet in
one step's loads (the planner would read one source for both): the scheduler side drops
such a request's loads before they leave (counted in ``identity_clashes``; vLLM
recomputes them).  The block directory counts a lookup that finds only another name with
the same low bits (``identity_mismatches``): a miss, never a load.
"""

from __future__ import annotations

import hashlib

#: bits of a block name
NAME_BITS = 192
ROW_KEY_MASK = (1 << 63) - 1


def block_name(block_hash: object) -> int:
    """The name of the block vLLM hashed to ``block_hash`` (bytes, int or anything with a
    stable ``repr``); equal hashes give equal names in every process (no Python
    ``hash()``, which is salted per process)."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        data = bytes(block_hash)
    elif isinstance(block_hash, int):
        data = block_hash.to_bytes((block_hash.bit_length() + 8) // 8 or 1, "little", signed=True)
    else:
        data = repr(block_hash).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=NAME_BITS // 8).digest(), "little")


def row_key(name: int) -> int:
    """The int64 ``key`` of a load row for the block named ``name`` (its low 63 bits)."""
    return name & ROW_KEY_MASK
