"""Parsing and validation of storage budgets (pure).

A budget is bytes: an int, or a string with an optional unit, binary
(``KiB``, ``MiB``, ``GiB``, ``TiB``, also ``K``/``M``/``G``/``T``) or
decimal (``KB``, ``MB``, ``GB``, ``TB``): ``"256MiB"``, ``"1.5 GiB"``,
``"2e9"``.  Errors are ``ValueError`` whose message starts with the option's
name and quotes the value, so a failed launch says what to fix.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Union

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
    "t": 2**40, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(option: str, value: Union[int, float, str]) -> int:
    """Bytes named by ``value``; raises ``ValueError`` naming ``option``."""
    if isinstance(value, bool):
        raise ValueError(f"{option}: expected a size in bytes such as 256MiB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        if m is None:
            raise ValueError(
                f"{option}: {value!r} is not a size (use bytes or a unit: KiB, MiB, GiB, TiB, "
                "KB, MB, GB, TB)")
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"{option}: unknown unit {m.group(2)!r} in {value!r}")
    else:
        raise ValueError(f"{option}: expected a size such as 256MiB, got {type(value).__name__}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{option}: must be a non-negative size, got {value!r}")
    return int(number * _UNITS[unit])


def validate_budget(option: str, value: Union[int, float, str], block_bytes: int,
                    available_bytes: Optional[int] = None, allow_zero: bool = False) -> int:
    """Parse ``value`` and check it holds at least one block (or is 0 when
    ``allow_zero``: the tier is off) and does not exceed ``available_bytes``.
    Returns the budget rounded down to whole blocks."""
    budget = parse_bytes(option, value)
    if block_bytes <= 0:
        raise ValueError(f"{option}: block size must be positive, got {block_bytes}")
    if budget == 0 and allow_zero:
        return 0
    if budget < block_bytes:
        raise ValueError(
            f"{option}: {value!r} ({budget} bytes) is smaller than one KV block "
            f"({block_bytes} bytes)")
    if available_bytes is not None and budget > available_bytes:
        raise ValueError(
            f"{option}: {value!r} ({budget} bytes) exceeds the {available_bytes} bytes available")
    return budget // block_bytes * block_bytes
