"""Xavier's figures in vLLM's connector statistics (``vllm_side/connector_stats.py``); the
path through a real engine is checked in ``test_connector_e2e.py``."""

from xinference.model.llm.vllm.xavier.planning.counters import Counters
from xinference.model.llm.vllm.xavier.vllm_side.connector import XavierConnector
from xinference.model.llm.vllm.xavier.vllm_side.connector_stats import (
    CounterDeltas,
    XavierKVConnectorStats,
)


def test_deltas_report_what_changed_since_the_last_report_and_nothing_otherwise():
    counters = Counters()
    counters.add("blocks_written", 5)  # before the first report: not counted
    deltas = CounterDeltas(counters.get)
    assert deltas.take() is None
    counters.add("blocks_written", 32)
    counters.add("useful_bytes", 32 * 65536)
    counters.add("hit_blocks", 32)  # scheduler-side figure: vLLM counts hits itself
    stats = deltas.take()
    assert stats is not None and stats.data == {"blocks_written": 32, "useful_bytes": 2097152}
    assert deltas.take() is None  # reported once


def test_stats_sum_over_workers_and_reduce_to_the_logged_line():
    a = XavierKVConnectorStats(data={"batch_calls": 1, "blocks_written": 32,
                                     "useful_bytes": 2 * 2**20})
    b = XavierConnector.build_kv_connector_stats({"batch_calls": 2, "export_exported": 7})
    total = a.aggregate(b)
    assert total.data == {"batch_calls": 3, "blocks_written": 32, "useful_bytes": 2 * 2**20,
                          "export_exported": 7}
    line = total.reduce()
    assert line["xavier_loads"] == 3 and line["loaded_blocks"] == 32
    assert line["loaded_MiB"] == 2.0 and line["exported_blocks"] == 7
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and XavierKVConnectorStats(data={"batch_calls": 0}).is_empty()
