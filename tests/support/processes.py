"""Prompts and processes the real-engine suites share."""

from __future__ import annotations

import random
from typing import List, Optional

import psutil


def tokens(seed: int, n: int) -> List[int]:
    """``n`` reproducible token ids inside the tiny model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def engine_cores(root: Optional[int] = None) -> List[psutil.Process]:
    """vLLM engine-core processes alive below ``root`` (default: this process); zombies
    count as gone."""
    alive = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "EngineCore" in " ".join(p.cmdline()):
                alive.append(p)
        except psutil.Error:
            continue
    return alive
