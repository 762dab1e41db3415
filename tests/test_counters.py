"""Counters: the fixed names, the shared-memory file another process reads, Prometheus."""

import multiprocessing as mp
import os
import time

import pytest

from xinference.model.llm.vllm.xavier.planning.counters import (
    ALL_NAMES,
    Counters,
    SharedCounters,
    TransferCounters,
    elapsed_us,
    prometheus_text,
    sum_snapshots,
)


def test_prometheus_text_has_every_counter_with_labels():
    c = TransferCounters(batch_calls=3, useful_bytes=1024)
    text = prometheus_text(c.snapshot(), {"rank": "1", "model": "m"})
    assert 'xavier_batch_calls_total{model="m",rank="1"} 3' in text
    assert 'xavier_useful_bytes_total{model="m",rank="1"} 1024' in text
    for name in c.snapshot():
        assert f"# TYPE xavier_{name}_total counter" in text
    gauge = prometheus_text({"storage_gpu_used_blocks": 5}, {"rank": "1"})
    assert "# TYPE xavier_storage_gpu_used_blocks gauge" in gauge


def test_unknown_names_are_refused():
    with pytest.raises(KeyError):
        Counters().add("no_such_counter")


def _writer(path: str) -> None:
    c = SharedCounters.open(path)
    c.add("blocks_written", 32)
    c.set("storage_cpu_used_blocks", 7)
    c.close()


def test_another_process_reads_what_the_writer_adds_and_the_file_goes_with_its_owner():
    owner = SharedCounters.create()
    owner.add("batch_calls")
    p = mp.get_context("spawn").Process(target=_writer, args=(owner.path,))
    p.start()
    p.join(300)  # a spawned interpreter imports torch and Xinference: ~60 s under load
    assert p.exitcode == 0
    reader = SharedCounters.open(owner.path)
    snap = reader.snapshot()
    assert set(snap) == set(ALL_NAMES)
    assert snap["batch_calls"] == 1 and snap["blocks_written"] == 32
    assert snap["storage_cpu_used_blocks"] == 7
    assert os.path.basename(owner.path).startswith(f"xavier-{os.getpid()}-")
    assert sum_snapshots(snap, {"batch_calls": 2})["batch_calls"] == 3
    reader.close()
    owner.close()
    owner.close()
    assert not os.path.exists(owner.path)
    assert TransferCounters.of(Counters()).batch_calls == 0


def test_activity_line_says_what_a_rank_did_since_the_last_one():
    from xinference.model.llm.vllm.xavier.planning.counters import activity_line

    before = {"queried_blocks": 10, "hit_blocks": 2, "batch_calls": 1}
    now = {"queried_blocks": 74, "hit_blocks": 34, "requests_with_hits": 1, "hit_tokens": 512,
           "blocks_written": 32, "batch_calls": 2, "export_calls": 3, "export_exported": 40,
           "export_skipped_no_slot": 4, "storage_gpu_used_blocks": 40,
           "storage_gpu_free_blocks": 60}
    assert activity_line(2, now, before) == (
        "xavier rank 2: external hit rate 50.0 % (32 of 64 blocks asked, 1 requests, 512 "
        "tokens); loaded 32 blocks in 1 calls, 0 failed, 0 blocks unreachable (recomputed); "
        "exported 40 blocks, 4 skipped (no free slot); storage blocks used GPU 40/100")
    assert activity_line(2, now, now) is None  # nothing happened: no line


def test_a_counters_path_named_by_another_process_must_be_a_xavier_counters_file(tmp_path):
    """What a worker names to its rank's actor (``register_engine(counters_path=...)``):
    the actor maps and writes that file, so anything but a regular Xavier counters file in
    the shared-memory directory is refused, naming the field (negative control: the real
    one opens)."""
    real = SharedCounters.create()
    outside = tmp_path / os.path.basename(real.path)
    outside.write_bytes(b"\0" * 8 * len(ALL_NAMES))
    link = os.path.join(os.path.dirname(real.path), os.path.basename(real.path)[:-4] + "beef")
    os.symlink(str(outside), link)
    small = SharedCounters.create()
    os.truncate(small.path, 8)
    try:
        for path, why in [(str(outside), "not in"), (link, "Too many levels of symbolic"),
                          ("/etc/passwd", "not in"), (small.path, "8 bytes, expected"),
                          (real.path[:-1] + "0" if real.path[-1] != "0" else real.path[:-1]
                           + "1", "No such file")]:
            with pytest.raises(ValueError, match=f"^counters_path: .* refused \\({why}"):
                SharedCounters.open_checked(path)
        opened = SharedCounters.open_checked(real.path)
        real.add("queries", 3)
        assert opened.get("queries") == 3
        opened.close()
    finally:
        os.unlink(link)
        real.close()
        small.close()


def test_every_figure_of_the_scheduler_s_step_is_a_counter():
    """The worker adds each ``StepStats`` field to its counters by name (an unknown name
    raises there, in vLLM's step): every field must be one (the cost model's estimates are
    levels: set, not added)."""
    from xinference.model.llm.vllm.xavier.planning.counters import ALL_NAMES, GAUGE_NAMES
    from xinference.model.llm.vllm.xavier.planning.step_meta import StepStats

    names = set(StepStats().as_dict())
    assert names - set(ALL_NAMES) == set()
    assert names & set(GAUGE_NAMES) == {"cost_prefill_ns_per_token", "cost_step_fixed_us",
                                        "cost_hit_wait_us", "host_index_peers",
                                        "host_index_whole_launch"}


def test_a_timed_block_s_cpu_time_is_apart_from_its_waiting():
    """``export_launch_cpu_us`` / ``load_launch_cpu_us``: a block that waits (sleeps) counts
    its wall time and almost no CPU; one that computes counts about as much CPU as wall."""
    got: dict = {}

    def timed(name: str):
        return elapsed_us(lambda us: got.__setitem__(name + "_us", us),
                          lambda us: got.__setitem__(name + "_cpu_us", us))

    with timed("wait"):
        time.sleep(0.05)
    with timed("work"):
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    assert got["wait_us"] >= 50_000 and got["wait_cpu_us"] < 10_000, got
    assert got["work_cpu_us"] >= 50_000 and got["work_cpu_us"] <= got["work_us"] + 1_000, got
    with pytest.raises(RuntimeError), timed("raised"):
        raise RuntimeError("still timed")
    assert "raised_us" in got and "raised_cpu_us" in got
