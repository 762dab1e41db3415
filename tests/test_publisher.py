"""The publisher thread (mechanism/publisher.py): in-place publications registered in the
directory, or -- the whole launch on this host -- written into the worker's host index
only; the switch each way in order: the rank's in-place entries dropped from the directory
before the first local one, every block the index says the engine still holds registered
again before the first one after them that is not local."""

import threading
import time
from typing import List

import pytest

from tests.support.host_indexes import VLLM, Engine, names
from xinference.model.llm.vllm.xavier.mechanism.host_index import HostIndexLink, name_words
from xinference.model.llm.vllm.xavier.mechanism.publisher import Publication, Publisher
from xinference.model.llm.vllm.xavier.mechanism.quiet_gate import QuietGate
from xinference.model.llm.vllm.xavier.planning.counters import Counters
from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory

RANK = 1


class World:
    """Rank 1's engine (block generations, host index), its link and publisher."""

    def __init__(self) -> None:
        self.engine = Engine(rank=RANK)
        self.directory = LocalDirectory()
        self.directory.directory.register_rank(RANK)
        self.link = HostIndexLink(self.directory, self.engine.index, lambda: None)
        self.counters = Counters()
        self.done: List[Publication] = []
        self._all_done = threading.Condition()
        self.publisher = Publisher(RANK, self.link, incarnation=77, sink=self.counters,
                                   done=self._finished)

    def _finished(self, pub: Publication) -> None:
        with self._all_done:
            self.done.append(pub)
            self._all_done.notify_all()

    def publish(self, held: List[int], first_block: int, local: bool) -> None:
        """Blocks ``first_block...`` now hold ``held`` (their forward completed)."""
        row = self.engine.row
        entries = [(0, name, VLLM, first_block + i, int(row[first_block + i]))
                   for i, name in enumerate(held)]
        n = len(self.done)
        self.publisher.put(Publication(entries, [], None, incarnation=self.engine.index.incarnation,
                                       local=local))
        with self._all_done:
            assert self._all_done.wait_for(lambda: len(self.done) > n, 30)

    def in_directory(self, held: List[int]) -> int:
        """How many of ``held`` (a prefix) the directory answers a peer."""
        return self.directory.directory.query(0, held, exclude_rank=2, lease=False).num_hits

    def in_index(self, held: List[int]) -> int:
        return int((self.engine.index.find(0, name_words(held))[0] >= 0).sum())

    def close(self) -> None:
        self.publisher.close(30)
        self.engine.close()


class Slow:
    """The link of a busy directory: its registrations held until the test lets them go
    (``gate``), their sizes recorded (``calls``)."""

    def __init__(self, inner):
        self.inner, self.calls, self.gate = inner, [], threading.Event()

    def register(self, rank, entries, incarnation=0):
        self.calls.append(len(entries))
        assert self.gate.wait(30)
        return self.inner.register(rank, entries, incarnation)

    def __getattr__(self, name):  # LocalPublishing: the host index link's
        return getattr(self.inner, name)


def slow_world():
    """A :class:`World` whose publisher registers through :class:`Slow`."""
    w = World()
    w.publisher.close(30)
    slow = Slow(w.link)
    w.publisher = Publisher(RANK, slow, incarnation=77, sink=w.counters, done=w._finished)
    return w, slow


def test_local_publications_skip_the_directory_and_the_switches_keep_it_true():
    w = World()
    try:
        first, second, third = names(4), names(3), names(2)
        w.publish(first, 0, local=False)  # (two replicas, one not announced yet)
        assert w.in_directory(first) == 4 and w.in_index(first) == 4
        # the whole launch on this host: the first local publication drops rank 1's
        # in-place entries from the directory first; its own blocks go into the index only
        w.publish(second, 10, local=True)
        assert w.in_directory(first) == 0 and w.in_directory(second) == 0
        assert w.in_index(second) == 3 and w.in_index(first) == 4
        c = w.counters.snapshot()
        assert c["in_place_kept_local"] == 3 and c["in_place_registered"] == 7
        # vLLM hands block 1 out again (the scheduler bumped it; no forget is sent while
        # local): the engine holds first[0], first[2:], second
        w.engine.row[1] += 1
        # a replica of another host joined: before the next registration everything the
        # index says the engine still holds is registered again -- not block 1
        w.publish(third, 20, local=False)
        assert w.in_directory(first) == 1 and w.in_directory(first[2:]) == 2
        assert w.in_directory(second) == 3 and w.in_directory(third) == 2
        c = w.counters.snapshot()
        assert c["in_place_republished"] == 6 and c["in_place_kept_local"] == 3
        assert c.get("in_place_register_failures", 0) == 0
    finally:
        w.close()


def test_a_switch_to_local_that_fails_keeps_registering():
    """A directory link that cannot drop the rank's in-place entries (here: one with no
    host index behind it) leaves the publications registered, counted as a failure;
    nothing is lost."""

    class NoIndex:  # (a link without LocalPublishing)
        def __init__(self, inner):
            self.inner = inner

        def register(self, rank, entries, incarnation=0):
            return self.inner.register(rank, entries, incarnation)

    w = World()
    w.publisher.close(30)
    w.publisher = Publisher(RANK, NoIndex(w.directory), incarnation=77, sink=w.counters,
                            done=w._finished)
    try:
        held = names(3)
        w.publish(held, 0, local=True)
        assert w.in_directory(held) == 3
        c = w.counters.snapshot()
        assert c["in_place_register_failures"] == 1 and c.get("in_place_kept_local", 0) == 0
    finally:
        w.close()


def test_the_directory_forgets_a_ranks_in_place_entries_only():
    """``forget_in_place``: the rank's entries of vLLM's cache go; its tiers' entries and
    its announced host index stay (a replica keeps publishing, locally)."""
    from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker

    tracker = VLLMBlockTracker.__new__(VLLMBlockTracker)
    VLLMBlockTracker.__init__(tracker)
    tracker.register_rank(RANK)
    tracker.announce_index(RANK, 0, "h1", "/dev/shm/a")
    in_place, saved = names(3), names(2)
    tracker.register(RANK, [(0, k, VLLM, i, 1) for i, k in enumerate(in_place)], 5)
    tracker.register(RANK, [(0, k, 0, i, 1) for i, k in enumerate(saved)], 6)  # GPU tier
    assert tracker.forget_in_place(RANK) == 3
    assert tracker.query_many([0], [in_place], 2, False)[0].num_hits == 0
    assert tracker.query_many([0], [saved], 2, False)[0].num_hits == 2
    assert tracker.host_view("h1") == ([(RANK, 0, "/dev/shm/a")], True)


def test_a_switch_with_no_blocks_is_made_in_order_and_registers_nothing():
    """The scheduler's flag changed in a step with no newly full block: the publisher
    switches anyway (the scheduler skips its forgets from that step on)."""
    w = World()
    try:
        held = names(2)
        w.publish(held, 0, local=False)
        w.publish([], 0, local=True)
        assert w.in_directory(held) == 0
        w.publish([], 0, local=False)
        assert w.in_directory(held) == 2 and w.counters.snapshot()["in_place_republished"] == 2
    finally:
        w.close()


def test_a_tensor_parallel_worker_forgets_its_own_shard_only():
    """Each TP worker's publisher switches on its own: worker 0 going local drops its
    shard's directory groups, not worker 1's (which may still register, or have just
    registered again)."""
    from xinference.model.llm.vllm.xavier.planning.directory_link import ShardLink
    from xinference.model.llm.vllm.xavier.planning.shards import Shards

    shards = Shards(num_groups=1, tp_size=2)
    directory = LocalDirectory()
    engines = [Engine(rank=RANK, tp_rank=tp) for tp in (0, 1)]
    try:
        links = [ShardLink(HostIndexLink(directory, e.index, lambda: None), shards, tp)
                 for tp, e in enumerate(engines)]
        held = names(3)
        for e, link in zip(engines, links):
            link.register(RANK, [(0, k, VLLM, i, int(e.row[i])) for i, k in enumerate(held)],
                          e.index.incarnation)
        groups = [shards.directory_group(0, tp) for tp in (0, 1)]

        def hits(tp):
            return directory.directory.query(groups[tp], held, 2, lease=False).num_hits

        assert hits(0) == hits(1) == 3
        assert links[0].forget_in_place(RANK) == 3
        assert hits(0) == 0 and hits(1) == 3
    finally:
        for e in engines:
            e.close()


def test_publications_queued_behind_a_slow_directory_call_go_in_one_call_in_order():
    """A busy directory answers late: the publications that queued meanwhile are registered
    in ONE call (fewer, larger calls as its load rises), in order; a switch among them
    still comes after every registration before it; each is reported done once."""

    w, slow = slow_world()
    try:
        inc, row = w.engine.index.incarnation, w.engine.row
        held = [names(2), names(3), names(1), names(2), names(2)]
        pubs = [Publication([(0, k, VLLM, 10 * n + i, int(row[10 * n + i]))
                             for i, k in enumerate(h)], [], None, incarnation=inc,
                            local=(n == 3)) for n, h in enumerate(held)]
        w.publisher.put(pubs[0])
        deadline = time.monotonic() + 30
        while not slow.calls:  # the publisher is inside its first call
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for pub in pubs[1:]:
            w.publisher.put(pub)
        slow.gate.set()
        with w._all_done:
            assert w._all_done.wait_for(lambda: len(w.done) == 5, 30)
        assert w.done == pubs
        # 2; then 3 + 1 together; the local one's switch after them; the switch back
        # (its republication) before the last one's own call
        assert slow.calls == [2, 4, 2]
        c = w.counters.snapshot()
        assert c["directory_calls_coalesced"] == 1 and c["in_place_kept_local"] == 2
        assert c["in_place_registered"] == 10 and c.get("in_place_register_failures", 0) == 0
        assert w.in_directory(held[4]) == 2 and w.in_directory(held[1]) == 3
        assert w.in_directory(held[3]) == 2  # registered again when the launch spread out
    finally:
        w.close()


def test_a_publication_whose_forward_is_still_running_holds_back_none_before_it():
    """The publications that queued behind a slow directory call are registered together,
    but one whose event (its forward, on the GPU) has not completed is left for the next
    call: waiting for it would hold back the registrations before it.  (A CUDA event
    cannot be made on the CPU machine: a stand-in with its two methods.)"""

    class Forward:  # torch.cuda.Event's query / synchronize
        def __init__(self):
            self.done = threading.Event()

        def query(self):
            return self.done.is_set()

        def synchronize(self):
            assert self.done.wait(30)

    w, slow = slow_world()
    try:
        inc, row = w.engine.index.incarnation, w.engine.row
        held = [names(1), names(2), names(3), names(4)]
        running = Forward()
        pubs = [Publication([(0, k, VLLM, 10 * n + i, int(row[10 * n + i]))
                             for i, k in enumerate(h)], [], running if n == 2 else None,
                            incarnation=inc) for n, h in enumerate(held)]
        w.publisher.put(pubs[0])
        deadline = time.monotonic() + 30
        while not slow.calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for pub in pubs[1:]:
            w.publisher.put(pub)
        slow.gate.set()  # the second call: pubs[1] alone, not waiting for pubs[2]'s forward
        with w._all_done:
            assert w._all_done.wait_for(lambda: len(w.done) == 2, 30)
        assert slow.calls == [1, 2] and w.in_directory(held[1]) == 2
        running.done.set()
        with w._all_done:
            assert w._all_done.wait_for(lambda: len(w.done) == 4, 30)
        assert w.done == pubs and slow.calls[2:] == [7]  # (it and the one after it)
    finally:
        w.close()


@pytest.mark.parametrize("quiet_s", [0.8, 0.0])
def test_a_deferred_directory_run_holds_back_no_host_index_write(quiet_s):
    """A worker launching loads every 10 ms (its quiet gate shut): a save's registration
    for the directory waits, a later in-place publication for the host index is written at
    once (it overtakes the run: another storage's rows), and the run goes once the worker
    is quiet.  Negative control: the gate off registers the run at once."""
    w = World()
    w.publisher.close(30)
    gate = QuietGate(quiet_s, 30.0, sink=w.counters)
    w.publisher = Publisher(RANK, w.link, incarnation=77, sink=w.counters, done=w._finished,
                            quiet=gate)
    w.publish(names(1), 5, local=True)  # (the switch to local: before the experiment)
    stop = threading.Event()

    def launching() -> None:
        while not stop.is_set():
            gate.busy()
            time.sleep(0.01)
    busy = threading.Thread(target=launching, daemon=True)
    busy.start()
    try:
        saved, held = names(3), names(2)
        w.publisher.put(Publication([(0, k, 0, i, 1) for i, k in enumerate(saved)], []))
        time.sleep(0.2)
        w.publish(held, 10, local=True)  # (waits until it is done)
        local_at = list(w.done[1:])
        in_directory = w.in_directory(saved)
        stop.set()
        busy.join()
        with w._all_done:
            assert w._all_done.wait_for(lambda: len(w.done) == 3, 30)
        assert w.in_index(held) == 2 and w.in_directory(saved) == 3
        if quiet_s:
            assert len(local_at) == 1 and local_at[0].local and in_directory == 0
            assert w.counters.get("background_deferrals") >= 1  # (each wait that held it)
        else:
            assert len(local_at) == 2 and in_directory == 3
    finally:
        stop.set()
        w.close()
