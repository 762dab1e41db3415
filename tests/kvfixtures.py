"""Paged KV caches and snapshot storages shaped like vLLM's, filled with random bits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.planning.load_batch import BlockLoad, LoadBatch
from xinference.model.llm.vllm.xavier.planning.options import XavierOptions

# group 0: two layers, block dim 0 (CPU_ATTN-like); group 1: one layer, block dim 1 (CUDA-like)
GROUP_SHAPES = {0: [((4, 8, 2), 0), ((4, 8, 2), 0)], 1: [((2, 4, 8), 1)]}
BLOCK_DIM = {0: 0, 1: 1}


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included) of ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    info = torch.iinfo(int_dtype)
    bits = torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=gen)
    return bits.view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    itemsize = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize])


def _layer_shape(block_shape: Tuple[int, ...], dim: int, n: int) -> Tuple[int, ...]:
    return block_shape[:dim] + (n,) + block_shape[dim:]


def make_caches(n_blocks: int, dtype: torch.dtype, gen: torch.Generator,
                device="cpu", groups=(0, 1)) -> Dict[int, List[torch.Tensor]]:
    out: Dict[int, List[torch.Tensor]] = {}
    for g in groups:
        out[g] = [random_bits(_layer_shape(bs, dim, n_blocks), dtype, gen, device)
                  for bs, dim in GROUP_SHAPES[g]]
    return out


def block(t: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    return t.select(dim, i)


@dataclass
class World:
    """Key contents and where each (rank, tier) storage holds which key."""

    contents: Dict[Tuple[int, int], List[torch.Tensor]]  # (group, key) -> per-layer block
    storages: Dict[Tuple[int, int], Dict[int, List[torch.Tensor]]]  # (rank, tier) -> caches
    slot_of: Dict[Tuple[int, int, int, int], int]  # (rank, tier, group, key) -> slot


def make_world(keys: List[int], holders: Dict[Tuple[int, int], List[int]], n_slots: int,
               dtype: torch.dtype, gen: torch.Generator, device="cpu") -> World:
    """Storages of ``n_slots`` slots per (rank, tier); ``holders[(rank, tier)]`` lists
    the keys it holds (both groups); slots are assigned in a shuffled order."""
    contents = {}
    for g in (0, 1):
        for k in keys:
            contents[(g, k)] = [random_bits(bs, dtype, gen, device) for bs, _ in GROUP_SHAPES[g]]
    storages, slot_of = {}, {}
    for (rank, tier), held in holders.items():
        caches = make_caches(n_slots, dtype, gen, device)
        perm = torch.randperm(n_slots, generator=gen).tolist()
        for i, k in enumerate(held):
            for g in (0, 1):
                slot = perm[i]
                slot_of[(rank, tier, g, k)] = slot
                for li, (layer, (_, dim)) in enumerate(zip(caches[g], GROUP_SHAPES[g])):
                    block(layer, dim, slot).copy_(contents[(g, k)][li])
        storages[(rank, tier)] = caches
    return World(contents, storages, slot_of)


def expected_after(local: Dict[int, List[torch.Tensor]], world: World,
                   dest_key: Dict[Tuple[int, int], int]) -> Dict[int, List[torch.Tensor]]:
    exp = {g: [t.clone() for t in ts] for g, ts in local.items()}
    for (g, d), k in dest_key.items():
        for li, (layer, (_, dim)) in enumerate(zip(exp[g], GROUP_SHAPES[g])):
            block(layer, dim, d).copy_(world.contents[(g, k)][li])
    return exp


def loads(rows) -> LoadBatch:
    return LoadBatch.from_requests(
        (f"req{i}", [BlockLoad(*r) for r in req]) for i, req in enumerate(rows))


def engine_cache(blocks):
    """A one-group bf16 engine KV cache of ``blocks`` blocks, its layout, its block bytes."""
    cache = {0: [torch.zeros((blocks, 2, 16, 2, 8), dtype=torch.bfloat16) for _ in range(2)]}
    layout = layout_of(cache)
    return cache, layout, layout.groups[0].block_bytes


def opts(**kw):
    base = {"rank": 1, "rank_address": "a", "block_tracker_address": "b",
            "block_tracker_uid": "t"}
    return XavierOptions.from_xavier_config({**base, **kw}, {})
