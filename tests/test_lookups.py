"""DirectoryLookups: one call for the lookups queued since the last, bounded waits, late
and dropped answers forgotten, a failing directory is a miss.  Answers hold no lease (the
scheduler half leases what a step loads: test_scheduler_side.py)."""

import concurrent.futures
import threading
from typing import List

from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.planning.lookups import DirectoryLookups, State


class Directory:
    """A real directory behind futures the test completes when it wants."""

    def __init__(self, held: int = 4) -> None:
        self.d = BlockDirectory()
        self.d.register_rank(1)
        self.d.register(1, [(0, 100 + i, 0, i, 1) for i in range(held)])
        self.calls: List[List[str]] = []
        self.futures: List[concurrent.futures.Future] = []
        self.answer_now = True

    def send(self, batch):
        self.calls.append([rid for rid, _ in batch])
        fut = concurrent.futures.Future()
        results = self.d.query_many([0], [keys for _, keys in batch], 2, False)
        if self.answer_now:
            fut.set_result(results)
        else:
            self.futures.append(fut)
            fut._results = results  # type: ignore[attr-defined]
        return fut

    def answer(self):
        for fut in self.futures:
            fut.set_result(fut._results)  # type: ignore[attr-defined]
        self.futures = []

    def release(self, ids):
        self.d.release(list(ids))


def test_queued_lookups_leave_in_one_call_and_are_taken_once():
    dr = Directory()
    lk = DirectoryLookups(dr.send)
    for rid in ("a", "b", "c"):
        lk.ask(rid, 0, [100, 101, 102])
    state, got = lk.take("b")
    assert state is State.DONE and got is not None and got.result.num_hits == 3
    assert dr.calls == [["a", "b", "c"]]  # one call carried all three
    assert dr.d.outstanding_leases == 0  # an answer pins no source slot
    assert lk.take("a")[0] is State.DONE and lk.take("c")[0] is State.DONE
    assert lk.take("c")[0] is State.NONE  # taken once
    assert lk.take_stats()["lookup_calls"] == 1


def test_a_slow_directory_is_waited_for_once_per_step_then_pending_then_given_up():
    dr = Directory()
    dr.answer_now = False
    clock = [0.0]
    lk = DirectoryLookups(dr.send, wait_budget_s=0.01, give_up_s=0.25,
                          clock=lambda: clock[0])
    lk.ask("a", 0, [100, 101])
    lk.ask("b", 0, [100])
    assert lk.take("a")[0] is State.PENDING  # waited (the budget), not answered
    assert lk.take("b")[0] is State.PENDING
    stats = lk.take_stats()
    assert stats["lookups_deferred"] == 2 and stats["lookup_calls"] == 1
    lk.new_step()
    dr.answer()
    assert lk.take("a")[0] is State.DONE  # next step: the answer is there
    lk.ask("c", 0, [100, 101, 102])
    assert lk.take("c")[0] is State.PENDING
    clock[0] += 0.3  # too long: proceed as a miss
    assert lk.take("c")[0] is State.MISS and lk.take_stats()["lookups_given_up"] == 1
    dr.answer()  # the late answer is dropped
    assert lk.take("c")[0] is State.NONE
    lk.drop("b")  # b's answer was there but nobody took it
    assert lk.outstanding == 0


def test_the_wait_ends_when_the_answer_arrives():
    dr = Directory()
    dr.answer_now = False
    lk = DirectoryLookups(dr.send, wait_budget_s=5.0)
    lk.ask("a", 0, [100])
    threading.Timer(0.05, dr.answer).start()
    state, got = lk.take("a")
    assert state is State.DONE and got.result.num_hits == 1
    assert lk.take_stats()["lookup_wait_us"] < 4_000_000


def test_a_failing_directory_is_a_miss_never_an_error():
    def broken(batch):
        fut = concurrent.futures.Future()
        fut.set_exception(ConnectionError("directory gone"))
        return fut

    lk = DirectoryLookups(broken)
    lk.ask("a", 0, [1, 2])
    assert lk.take("a")[0] is State.MISS

    def raising(batch):
        raise ConnectionError("no directory actor")

    lk = DirectoryLookups(raising)
    lk.ask("a", 0, [1, 2])
    assert lk.take("a")[0] is State.MISS


def test_asking_again_replaces_the_answer():
    dr = Directory()
    lk = DirectoryLookups(dr.send)
    lk.ask("a", 0, [100, 101, 102, 103])
    lk.flush()
    lk.ask("a", 2, [102, 103])  # e.g. the local hit grew: only the rest is needed
    state, got = lk.take("a")
    assert state is State.DONE and got.start == 2 and got.result.num_hits == 2
