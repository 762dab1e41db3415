"""The host index (mechanism/host_index.py): a worker's table of the blocks it published in
place, probed by the schedulers of its same-host peers without a directory round trip.
The table alone (moved generations, other names and groups, torn entries, full buckets,
files that are not what they claim), the worker's link (what it writes and announces), and
the directory's announcements.  The schedulers' view of the indexes: test_host_holders.py."""

import os
import secrets
from typing import List

import numpy as np
import pytest

from tests.support.host_indexes import VLLM, Engine, names
from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.mechanism import host_index as hi
from xinference.model.llm.vllm.xavier.mechanism.host_index import (
    HostIndex,
    HostIndexLink,
    name_words,
)
from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier
from xinference.model.llm.vllm.xavier.planning.shm_words import owned_name


def test_what_a_worker_publishes_another_mapping_finds_and_nothing_else():
    e = Engine(rank=1, num_blocks=4096)  # (no bucket of 8 overflows: every name stays)
    try:
        held = names(40)
        e.row[:] = 3  # (blocks handed out three times before)
        e.publish(held)
        reader = HostIndex.open(e.index.path)
        block, gen, seen = reader.find(0, name_words(held))
        assert block.tolist() == list(range(40)) and set(gen.tolist()) == {3} and seen.all()
        assert (reader.find(1, name_words(held[:4]))[0] == -1).all()  # another group
        assert (reader.find(0, name_words(names(4)))[0] == -1).all()  # other names
        # a name equal in its low 63 bits (what a load row carries) is another name here
        twin = (held[0] & ((1 << 63) - 1)) | (1 << 100)
        assert reader.find(0, name_words([twin]))[0][0] == -1
        # vLLM hands block 5 out again (the scheduler bumps it before anything writes it):
        # its entry is a miss at once, the others stay
        e.row[5] += 1
        block, _, seen = reader.find(0, name_words(held[:8]))
        assert block.tolist() == [0, 1, 2, 3, 4, -1, 6, 7] and seen.all()  # (5: held once)
        # one name in two blocks (two ways of its bucket, the first one's block then
        # handed out): the live entry is found, never hidden by the moved one before it
        twice = names(1)[0]
        e.index.insert([(0, twice, 41, int(e.row[41])), (0, twice, 42, int(e.row[42]))])
        ways = np.flatnonzero(e.index._table[:, :, 3] & 0xFFFFFFFF == 41)
        assert len(ways) == 1
        e.row[41] += 1
        assert reader.find(0, name_words([twice]))[0].tolist() == [42]
        # the owner closes (its engine went): a reader still mapping the file finds nothing
        e.index.close()
        block, _, seen = reader.find(0, name_words(held[:3]))
        assert (block == -1).all() and not seen.any()
        reader.close()
    finally:
        e.close()


def test_a_torn_entry_fails_its_check():
    """An entry read while the writer replaces it (one entry's name, another's block):
    faked here by writing half of an entry, which a reader could otherwise only see by
    chance.  With its check word recomputed the same entry is found: the check is what
    keeps it out."""
    e = Engine(rank=1)
    try:
        held = names(8)
        e.publish(held)
        table = e.index._table
        (b0, w0), (b1, w1) = np.argwhere(table[:, :, 7] != 0)[:2]
        table[b0, w0, 3] = table[b1, w1, 3]  # entry 0's name with entry 1's block
        reader = HostIndex.open(e.index.path)
        w = [int(x) for x in table[b0, w0, :3]]
        torn_name = w[0] | w[1] << 64 | w[2] << 128
        assert reader.find(0, name_words([torn_name]))[0][0] == -1
        table[b0, w0, 7] = hi._mix(table[b0, w0, :7][None], e.index._salt)[0]
        assert reader.find(0, name_words([torn_name]))[0][0] == int(table[b1, w1, 3]) & 0xFFFFFFFF
        reader.close()
    finally:
        e.close()


def _scan(index: HostIndex, group: int, name: int):
    """What ``find`` must answer for one name, by looking at every way of its bucket in
    turn: the first intact entry of the name at its block's current generation, and
    whether any intact entry names it."""
    words = name_words([name])[0]
    bucket = int(hi._buckets_of(words[:1], np.array([group]), index._mask)[0])
    found, seen = (-1, -1), False
    for entry in index._table[bucket]:
        block = int(entry[3]) & 0xFFFFFFFF
        intact = (all(int(entry[i]) == int(words[i]) for i in range(3))
                  and int(entry[3]) >> 32 == group
                  and int(hi._mix(entry[None, :7], index._salt)[0]) == int(entry[7])
                  and int(entry[5]) == index.incarnation and block < index.num_blocks)
        if not intact:
            continue
        seen = True
        if found[0] < 0 and int(index._generations[block]) == int(entry[4]):
            found = (block, int(entry[4]))
    return found[0], found[1], seen


def test_find_answers_what_a_scan_of_every_way_answers():
    """``find`` checks only the ways whose first name word matches: the same answers as a
    scan of every way, with names that share their first word, entries of the same name
    at moved generations (stale before live in a bucket), torn entries, other groups and
    names never published."""
    rng = np.random.default_rng(7)
    e = Engine(rank=1, num_blocks=64)
    try:
        base = names(120)
        twins = [(n & ((1 << 64) - 1)) | (secrets.randbits(128) << 64) for n in base[:20]]
        pool = base + twins
        for _ in range(6):  # publish, then hand a quarter of the blocks out again
            picked = rng.choice(len(pool), 64, replace=False)
            e.index.insert([(int(rng.integers(2)), pool[p], int(b), int(e.row[b]))
                            for p, b in zip(picked, rng.integers(0, 64, 64))])
            e.row[rng.choice(64, 16, replace=False)] += 1
        table = e.index._table
        for b, w, word in zip(rng.integers(0, len(table), 6), rng.integers(0, hi.WAYS, 6),
                              rng.integers(0, hi.ENTRY_WORDS, 6)):
            table[b, w, word] ^= np.uint64(1 << int(rng.integers(60)))  # torn
        asked = pool + names(10)
        counts = {"live": 0, "seen": 0}
        for group in (0, 1):
            block, gen, seen = e.index.find(group, name_words(asked))
            for i, name in enumerate(asked):
                assert (int(block[i]), int(gen[i]), bool(seen[i])) == _scan(e.index, group, name)
            counts["live"] += int(np.count_nonzero(block >= 0))
            counts["seen"] += int(np.count_nonzero(seen & (block < 0)))
        assert counts["live"] > 20 and counts["seen"] > 5  # (the cases occurred)
    finally:
        e.close()


def test_a_full_bucket_takes_a_moved_entry_first_then_the_oldest():
    e = Engine(rank=1, num_blocks=4)  # 2 x 4 entries: one bucket of 8 ways
    try:
        assert e.index._table.shape[:2] == (1, hi.WAYS)
        first = names(8)
        for i, n in enumerate(first):
            e.index.insert([(0, n, i % 4, 0)])
        e.row[2] += 1  # block 2 handed out: the entries naming it moved on
        e.publish(names(1), first_block=0)
        reader = HostIndex.open(e.index.path)
        found = reader.find(0, name_words(first))[0]
        # one of the two moved entries (blocks 2) gave way, every live one stayed
        assert found.tolist() == [0, 1, -1, 3, 0, 1, -1, 3]
        more = names(2)
        e.index.insert([(0, more[0], 3, 0)])  # a way still held by a moved entry
        e.index.insert([(0, more[1], 3, 0)])  # none left: the oldest goes (first[0])
        found = reader.find(0, name_words(first))[0]
        assert found[0] == -1 and found[1] == 1 and found[3] == 3
        assert (reader.find(0, name_words(more))[0] == 3).all()
        reader.close()
    finally:
        e.close()


def test_a_full_bucket_overwrites_its_oldest_stale_entry_first():
    """Stale entries (blocks handed out since) still say a peer held the name once (the
    ``shared`` save policy reads that): of two, the older gives way, whatever its way."""
    e = Engine(rank=1, num_blocks=4)  # one bucket of 8 ways
    try:
        first = names(8)
        for i, n in enumerate(first):
            e.index.insert([(0, n, i % 4, 0)])
        e.index.insert([(0, first[0], 0, 0)])  # way 0 written again: now the newest
        e.row[0] += 1  # block 0 handed out: ways 0 and 4 stale, way 4 the older
        e.publish(names(1), first_block=1)
        reader = HostIndex.open(e.index.path)
        held, _, seen = reader.find(0, name_words(first))
        assert held.tolist() == [-1, 1, 2, 3, -1, 1, 2, 3]
        assert seen.tolist() == [True] * 4 + [False] + [True] * 3
        reader.close()
    finally:
        e.close()


def test_a_file_that_is_not_an_index_is_refused_naming_it(tmp_path):
    e = Engine(rank=1)
    try:
        with pytest.raises(ValueError, match="is not an Xavier shared-memory file"):
            HostIndex.open("/etc/passwd")
        link = owned_name()
        os.symlink(e.index.path, link)
        try:
            with pytest.raises(ValueError, match="not an Xavier"):  # a symlink: refused
                HostIndex.open(link)
        finally:
            os.unlink(link)
        with pytest.raises(ValueError, match="holds format"):
            HostIndex.open(e.gens.path)  # another Xavier file: the generations
    finally:
        e.close()


def test_the_worker_link_writes_its_own_in_place_entries_and_announces_them():
    e = Engine(rank=1)
    directory = LocalDirectory()
    announced: List[int] = []
    now = [100.0]
    link = HostIndexLink(directory, e.index, lambda: announced.append(1), clock=lambda: now[0])
    try:
        held = names(3)
        inc = e.index.incarnation
        link.register(1, [(0, held[0], VLLM, 0, 0), (0, held[1], 1, 7, 1)], inc)
        link.register(1, [(0, held[2], VLLM, 2, 0)], inc + 1)  # another engine's: not here
        reader = HostIndex.open(e.index.path)
        assert reader.find(0, name_words(held))[0].tolist() == [0, -1, -1]
        assert directory.directory.num_blocks == 3  # everything still reaches the directory
        assert announced == [1]
        now[0] += hi.ANNOUNCE_PERIOD_S + 1
        link.register(1, [(0, held[2], VLLM, 2, 0)], inc)
        assert announced == [1, 1] and reader.find(0, name_words(held))[0][2] == 2
        reader.close()
    finally:
        e.close()


def test_the_directory_announces_indexes_per_host_until_the_rank_goes():
    tracker = VLLMBlockTracker.__new__(VLLMBlockTracker)
    VLLMBlockTracker.__init__(tracker)
    with pytest.raises(ValueError, match="^rank: 5 is not registered"):
        tracker.announce_index(5, 0, "h1", "/dev/shm/x")
    tracker.register_rank(1)
    tracker.register_rank(2)
    tracker.announce_index(1, 0, "h1", "/dev/shm/a")
    tracker.announce_index(2, 0, "h2", "/dev/shm/b")
    assert tracker.host_indexes("h1") == [(1, 0, "/dev/shm/a")]
    assert tracker.host_indexes("h1", exclude_rank=1) == []
    tracker.unregister_rank(1)
    assert tracker.host_indexes("h1") == []
    tracker.register_rank(1)
    tracker.announce_index(1, 0, "h1", "/dev/shm/c")
    tracker.forget(1, int(Tier.VLLM), None)  # its engine shut down (release_engine)
    assert tracker.host_indexes("h1") == []


def test_a_rank_dropped_and_taken_back_announces_its_index_with_its_next_registration():
    """The registry's liveness check dropped a live rank (its host indexes went with it) and
    took it back: the rank's next registration of blocks registers it in the directory
    again and its announcement is accepted (made before the registration, it was refused
    -- `rank: 1 is not registered` -- and the index stayed unknown to its peers until the
    next announcement, ANNOUNCE_PERIOD_S later)."""
    tracker = VLLMBlockTracker.__new__(VLLMBlockTracker)
    VLLMBlockTracker.__init__(tracker)

    class Direct:  # the worker's TrackerLink, without the bridge
        def register(self, rank, entries, incarnation=0):
            return tracker.register(rank, entries, incarnation)

    e = Engine(rank=1)
    now = [100.0]
    link = HostIndexLink(Direct(), e.index,
                         lambda: tracker.announce_index(1, 0, "h1", e.index.path),
                         clock=lambda: now[0])
    try:
        held = names(2)
        tracker.register_rank(1)
        link.register(1, [(0, held[0], VLLM, 0, 0)], e.index.incarnation)
        assert tracker.host_indexes("h1") == [(1, 0, e.index.path)]
        tracker.unregister_rank(1)  # dropped as unreachable, then taken back
        assert tracker.host_indexes("h1") == []
        now[0] += hi.ANNOUNCE_PERIOD_S + 1
        link.register(1, [(0, held[1], VLLM, 1, 0)], e.index.incarnation)
        assert tracker.host_indexes("h1") == [(1, 0, e.index.path)]
    finally:
        e.close()


def test_live_rows_are_what_the_engine_holds_now():
    """What a republication registers: every intact entry whose block still holds it --
    not a block handed out since, not a torn entry, not another incarnation's."""
    e = Engine(rank=1)
    try:
        held = names(6)
        e.publish(held)
        e.publish(names(1), group=3, first_block=9)
        e.row[2] += 1  # handed out again
        table = e.index._table
        way = np.flatnonzero(table[:, :, 3] & 0xFFFFFFFF == 4)  # block 4's entry, torn
        bucket, w = divmod(int(way[0]), table.shape[1])
        table[bucket, w, 2] ^= np.uint64(1)
        rows = e.index.live_rows()
        assert sorted(((g, n, b) for g, n, b, _ in rows if g == 0), key=lambda r: r[2]) == [
            (0, held[i], i) for i in (0, 1, 3, 5)]
        assert [(g, b) for g, _, b, _ in rows if g != 0] == [(3, 9)]
        assert {gen for _, _, _, gen in rows} == {int(e.row[0])}
    finally:
        e.close()
