"""Xavier's figures in vLLM's own connector statistics (vLLM's ``KVConnectorStats``).

vLLM asks each worker's connector for its statistics after every step
(``get_kv_connector_stats``), adds up what the workers returned in the scheduler, and its
stat logger prints ``KV Transfer metrics: ...`` once per logging interval (next to its own
``External prefix cache hit rate``, which vLLM already counts for any connector).  Xavier
registers no Prometheus series with vLLM: its series are in Xinference's metrics endpoint
(:mod:`..planning.counters`).

The worker reports the change of a few of its counters since it last reported
(:class:`CounterDeltas`), nothing when none changed; the payload is a plain ``dict`` of
ints (vLLM ships it between processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: the worker counters reported to vLLM (names of :data:`..planning.counters.COUNTER_NAMES`)
#: and the names vLLM's log line shows them under (bytes are shown in MiB)
LOGGED_AS = {"batch_calls": "xavier_loads", "blocks_written": "loaded_blocks",
             "useful_bytes": "loaded_MiB", "load_failures": "failed_loads",
             "rows_unreachable": "unreachable_blocks", "export_exported": "exported_blocks",
             "export_skipped_no_slot": "exports_skipped_full_tier",
             "room_demoted": "demoted_blocks"}
REPORTED_COUNTERS = tuple(LOGGED_AS)


@dataclass
class XavierKVConnectorStats(KVConnectorStats):
    """Counter changes over an interval, summed over workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        total: Dict[str, int] = {k: int(v) for k, v in self.data.items()}
        for name, value in other.data.items():
            total[name] = total.get(name, 0) + int(value)
        return XavierKVConnectorStats(data=total)

    def reduce(self) -> Dict[str, int | float]:
        out: Dict[str, int | float] = {}
        for name, label in LOGGED_AS.items():
            value = int(self.data.get(name, 0))
            out[label] = round(value / 2**20, 1) if name == "useful_bytes" else value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """The change of :data:`REPORTED_COUNTERS` since the previous :meth:`take`."""

    def __init__(self, read: Callable[[str], int]) -> None:
        self._read = read
        self._last = {name: read(name) for name in REPORTED_COUNTERS}

    def take(self) -> Optional[XavierKVConnectorStats]:
        """The changes since the last call as vLLM's statistics, or None when nothing
        changed (vLLM then carries no payload for this step)."""
        now = {name: self._read(name) for name in REPORTED_COUNTERS}
        delta = {name: now[name] - self._last[name] for name in REPORTED_COUNTERS
                 if now[name] != self._last[name]}
        self._last = now
        return XavierKVConnectorStats(data=delta) if delta else None
