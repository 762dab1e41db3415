"""The load engine inside a real xoscar actor, for transfer_bench's RPC part."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import xoscar as xo

from xinference.model.llm.vllm.xavier.gpu_transfer import GPUTransfer
from xinference.model.llm.vllm.xavier.load_batch import LoadBatch, Tier
from xinference.model.llm.vllm.xavier.plan import SlabConfig, plan_step


class LoadBenchActor(xo.StatelessActor):
    def __init__(self, shape: Dict[str, Any], n_dest: int, n_slots: int) -> None:
        super().__init__()
        self._shape, self._n_dest, self._n_slots = shape, n_dest, n_slots
        self._engine = GPUTransfer(rank=0, slab_config=SlabConfig(512, 32, 2))

    async def __post_create__(self) -> None:
        from transfer_bench import Shape, make_layers  # type: ignore[import-not-found]

        shape = Shape(**self._shape)
        await self._engine.set_local_caches({0: make_layers(shape, self._n_dest, "cpu", 0)})
        for rank in (1, 2):
            await self._engine.map_storage(
                rank, Tier.GPU, {0: make_layers(shape, self._n_slots, "cpu", rank)})

    async def __pre_destroy__(self) -> None:
        await self._engine.close()

    async def noop(self) -> None:
        return None

    async def accept_batch(self, batch: LoadBatch) -> int:
        return batch.num_rows

    async def plan_only(self, batch: LoadBatch) -> int:
        plan, _ = plan_step(batch, self._engine.slab_config)
        return len(plan.transfers)

    async def accept_tuples(self, rows: List[Tuple[int, ...]]) -> int:
        return len(rows)

    async def load(self, batch: LoadBatch) -> int:
        res = await self._engine.load_gpu_requests_v1(batch)
        return res.blocks_written

    async def counters(self) -> Dict[str, int]:
        return self._engine.counters.snapshot()
