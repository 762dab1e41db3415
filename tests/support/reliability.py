"""The reliability suite's summary: each scenario records a row; pytest prints the table at
the end of the run (``tests/conftest.py``) and writes it as JSON to ``$XAVIER_RELIABILITY_JSON``
when that is set (``doc/reliability.md`` quotes such a run)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import List


@dataclass
class Row:
    scenario: str
    faults_tried: int
    survived: int
    requests_completed: int
    leaks_found: int
    detail: str = ""


ROWS: List[Row] = []


def record(scenario: str, faults_tried: int, survived: int, requests_completed: int,
           leaks_found: int, detail: str = "") -> None:
    ROWS.append(Row(scenario, faults_tried, survived, requests_completed, leaks_found, detail))


def table() -> List[str]:
    if not ROWS:
        return []
    w = max(len(r.scenario) for r in ROWS)
    lines = [f"{'scenario':<{w}}  faults  survived  requests  leaks  detail"]
    for r in ROWS:
        lines.append(f"{r.scenario:<{w}}  {r.faults_tried:>6}  {r.survived:>8}  "
                     f"{r.requests_completed:>8}  {r.leaks_found:>5}  {r.detail}")
    t = ROWS
    lines.append(f"{'total':<{w}}  {sum(r.faults_tried for r in t):>6}  "
                 f"{sum(r.survived for r in t):>8}  {sum(r.requests_completed for r in t):>8}  "
                 f"{sum(r.leaks_found for r in t):>5}")
    return lines


def write_json() -> None:
    out = os.environ.get("XAVIER_RELIABILITY_JSON")
    if out and ROWS:
        with open(out, "w") as f:
            json.dump([asdict(r) for r in ROWS], f, indent=1)
