"""Prompts and processes the real-engine suites share."""

from __future__ import annotations

import random
from typing import Callable, Iterable, List, Optional

import psutil


def tokens(seed: int, n: int) -> List[int]:
    """``n`` reproducible token ids inside the tiny model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def processes_below(root: Optional[int], matches: Callable[[str], bool]
                    ) -> List[psutil.Process]:
    """Processes alive below ``root`` (default: this process) whose command line
    ``matches``; zombies count as gone."""
    return [p for p in alive(psutil.Process(root).children(recursive=True))
            if _cmdline_matches(p, matches)]


def engine_cores(root: Optional[int] = None) -> List[psutil.Process]:
    """vLLM engine-core processes alive below ``root`` (default: this process)."""
    return processes_below(root, lambda cmdline: "EngineCore" in cmdline)


def alive(processes: Iterable[psutil.Process]) -> List[psutil.Process]:
    """Those of ``processes`` still running (zombies count as gone)."""
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _cmdline_matches(p: psutil.Process, matches: Callable[[str], bool]) -> bool:
    try:
        return matches(" ".join(p.cmdline()))
    except psutil.Error:
        return False
