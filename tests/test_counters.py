from xinference.model.llm.vllm.xavier.counters import TransferCounters, prometheus_text


def test_prometheus_text_has_every_counter_with_labels():
    c = TransferCounters(batch_calls=3, useful_bytes=1024)
    text = prometheus_text(c.snapshot(), {"rank": "1", "model": "m"})
    assert 'xavier_batch_calls_total{model="m",rank="1"} 3' in text
    assert 'xavier_useful_bytes_total{model="m",rank="1"} 1024' in text
    for name in c.snapshot():
        assert f"# TYPE xavier_{name}_total counter" in text
