"""Transfer counters and their export as Prometheus metrics."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Dict, Iterator, Mapping


@dataclass
class TransferCounters:
    """Monotonic counters of one rank's load engine.

    * ``logical_requests``: requests carried by load calls (a request with
      loads counts once per call that carries it);
    * ``batch_calls``: ``load_gpu_requests_v1`` calls that were executed;
    * ``transfers``: slab-bounded copies issued;
    * ``fused_transfers``: of those, copies done by the fused Triton kernel;
    * ``useful_bytes``: bytes of source blocks read (into a slab, or straight to the
      destination by the fused kernel);
    * ``padded_bytes``: slab capacity of those transfers left unfilled
      (bytes a fixed-shape wire transfer would carry in vain);
    * ``blocks_written``: destination blocks written (one read may feed several);
    * ``load_failures``: calls that raised after planning (validation or copy);
    * ``rejected_batches``: calls rejected before any copy (conflicts, bad input);
    * ``lease_release_failures``: leases whose release raised.
    """

    logical_requests: int = 0
    batch_calls: int = 0
    transfers: int = 0
    fused_transfers: int = 0
    useful_bytes: int = 0
    padded_bytes: int = 0
    blocks_written: int = 0
    load_failures: int = 0
    rejected_batches: int = 0
    lease_release_failures: int = 0

    def snapshot(self) -> Dict[str, int]:
        return asdict(self)


_HELP = {f.name: (f.name.replace("_", " ")) for f in fields(TransferCounters)}


def prometheus_text(counters: Mapping[str, int], labels: Mapping[str, str],
                    prefix: str = "xavier_") -> str:
    """Prometheus text exposition of a counter snapshot (``*_total`` counters)."""
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines = []
    for name, value in counters.items():
        metric = f"{prefix}{name}_total"
        lines.append(f"# HELP {metric} Xavier {_HELP.get(name, name)}")
        lines.append(f"# TYPE {metric} counter")
        lines.append(f"{metric}{{{label}}} {int(value)}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def elapsed_us(add: Callable[[int], None]) -> Iterator[None]:
    """Time the block (wall clock) and pass its microseconds to ``add``, also when it
    raises: the time counters (``load_call_us``, ``export_copy_us``, ...) are written so."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(int(1e6 * (time.perf_counter() - t0)))
