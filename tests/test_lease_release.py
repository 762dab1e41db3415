"""BatchingReleaser: releases asked from several threads become one directory call."""

import concurrent.futures
import threading

from xinference.model.llm.vllm.xavier.planning.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.planning.lease_release import BatchingReleaser


class Loop:
    """Stands in for the bridge's loop: scheduled callbacks run when ``run`` is called."""

    def __init__(self):
        self.callbacks = []

    def schedule(self, fn):
        self.callbacks.append(fn)

    def run(self):
        callbacks, self.callbacks = self.callbacks, []
        for fn in callbacks:
            fn()


def done_future(value=None, error=None):
    fut = concurrent.futures.Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
    return fut


def test_releases_of_many_threads_make_one_call_and_free_every_lease():
    d = BlockDirectory()
    d.register_rank(1)
    d.register(1, [(0, 100 + i, 0, i, 1) for i in range(512)])
    q = d.query(0, [100 + i for i in range(512)], exclude_rank=2)
    assert d.outstanding_leases == 512
    calls, loop = [], Loop()

    def send(ids):
        calls.append(list(ids))
        return done_future(d.release(ids))

    r = BatchingReleaser(send, loop.schedule)
    threads = [threading.Thread(target=lambda part=part: [r.release(i) for i in part])
               for part in (q.lease_ids[:256], q.lease_ids[256:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.release_many(())  # nothing: no call
    loop.run()
    assert len(calls) == 1 and sorted(calls[0]) == sorted(q.lease_ids)
    assert d.outstanding_leases == 0 and r.calls == 1


def test_a_failed_call_is_counted_and_the_next_batch_is_separate():
    attempts, loop = [], Loop()

    def send(ids):
        attempts.append(list(ids))
        if len(attempts) == 1:
            return done_future(error=ConnectionError("directory unreachable"))
        return done_future(len(ids))

    r = BatchingReleaser(send, loop.schedule)
    r.release_many([1, 2, 3])
    loop.run()
    r.release_many([4, 5])
    loop.run()
    assert attempts == [[1, 2, 3], [4, 5]] and r.failures == 1


def test_flush_sends_what_is_buffered_and_waits_for_the_calls():
    sent = []
    gate = concurrent.futures.Future()

    def send(ids):
        sent.append(list(ids))
        return gate

    r = BatchingReleaser(send, lambda fn: None)  # the loop never runs on its own
    r.release(7)
    threading.Timer(0.05, lambda: gate.set_result(1)).start()
    r.flush(timeout=5)
    assert sent == [[7]] and gate.done()


def test_a_failed_call_is_tried_again_until_the_directory_answers(monkeypatch):
    """A directory that restarts: the releases of the failed call are sent again, so no
    lease stays held (a slot under a lost lease would never be reused)."""
    import time

    from xinference.model.llm.vllm.xavier.planning import lease_release

    monkeypatch.setattr(lease_release, "RETRY_PAUSES_S", (0.01, 0.01))
    d = BlockDirectory()
    d.register_rank(1)
    d.register(1, [(0, 100, 0, 0, 1)])
    q = d.query(0, [100], exclude_rank=2)
    attempts = []

    def send(ids):
        attempts.append(list(ids))
        if len(attempts) < 3:
            return done_future(error=ConnectionError("directory restarting"))
        return done_future(d.release(ids))

    r = BatchingReleaser(send, lambda fn: fn())  # the loop runs callbacks at once
    r.release_many(q.lease_ids)
    deadline = time.monotonic() + 5
    while d.outstanding_leases and time.monotonic() < deadline:
        time.sleep(0.01)
    assert attempts == [list(q.lease_ids)] * 3 and d.outstanding_leases == 0
