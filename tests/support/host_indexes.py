"""Host indexes as the tests build them: one worker's block generations and its index."""

import secrets
from typing import List

from xinference.model.llm.vllm.xavier.mechanism.host_index import HostIndex
from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier

VLLM = int(Tier.VLLM)


class Engine:
    """One worker's block generations (as the scheduler bumps them) and its index."""

    def __init__(self, rank: int, num_blocks: int = 1024, tp_rank: int = 0,
                 tier_blocks: int = 0) -> None:
        self.gens = SlotGenerations.create_shared(VLLM, [0], num_blocks)
        self.row = self.gens.row(VLLM, 0)
        self.index = HostIndex.create(rank, tp_rank, self.gens, self.row,
                                      tier_blocks=tier_blocks)

    def publish(self, names: List[int], group: int = 0, first_block: int = 0) -> None:
        self.index.insert([(group, n, first_block + i, int(self.row[first_block + i]))
                           for i, n in enumerate(names)])

    def close(self) -> None:
        self.index.close()
        self.gens.close()


def names(n: int) -> List[int]:
    return [secrets.randbits(192) for _ in range(n)]
