"""The host index (mechanism/host_index.py): a worker's table of the blocks it published in
place, probed by the schedulers of its same-host peers without a directory round trip.
The table alone (another process writes, this one reads; moved generations, other names
and groups, torn entries, full buckets, files that are not what they claim), the reader's
view of its peers (HostHolders: TP shards, the longest peer), the worker's link (what it
writes and announces), and the directory's announcements."""

import multiprocessing
import os
import secrets
from typing import List

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.mechanism import host_index as hi
from xinference.model.llm.vllm.xavier.mechanism.host_index import (
    HostHolders,
    HostIndex,
    HostIndexLink,
    name_words,
)
from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations
from xinference.model.llm.vllm.xavier.planning.directory_link import LocalDirectory
from xinference.model.llm.vllm.xavier.planning.load_batch import NO_LEASE, Tier
from xinference.model.llm.vllm.xavier.planning.shards import Shards
from xinference.model.llm.vllm.xavier.planning.shm_words import owned_name

VLLM = int(Tier.VLLM)


class Engine:
    """One worker's block generations (as the scheduler bumps them) and its index."""

    def __init__(self, rank: int, num_blocks: int = 1024, tp_rank: int = 0) -> None:
        self.gens = SlotGenerations.create_shared(VLLM, [0], num_blocks)
        self.row = self.gens.row(VLLM, 0)
        self.index = HostIndex.create(rank, tp_rank, self.gens, self.row)

    def publish(self, names: List[int], group: int = 0, first_block: int = 0) -> None:
        self.index.insert([(group, n, first_block + i, int(self.row[first_block + i]))
                           for i, n in enumerate(names)])

    def close(self) -> None:
        self.index.close()
        self.gens.close()


def names(n: int) -> List[int]:
    return [secrets.randbits(192) for _ in range(n)]


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


def _publish_in_child(to_parent, to_child, held: List[int]) -> None:
    e = Engine(rank=4)
    e.publish(held)
    to_parent.put((e.index.path, e.gens.handle()))
    to_child.get()  # (the parent probes while this process owns the files)
    e.close()


def test_a_peer_process_finds_what_this_process_published():
    ctx = multiprocessing.get_context("fork")
    to_parent, to_child = ctx.Queue(), ctx.Queue()
    held = names(16)
    child = ctx.Process(target=_publish_in_child, args=(to_parent, to_child, held))
    child.start()
    try:
        path, _ = to_parent.get(timeout=30)
        holders = HostHolders(own_rank=2, shards=Shards(1, 1))
        holders.update([(4, 0, path)])
        found, evicted_next = holders.find(held + names(2))
        assert found.keys == tuple(held) and not evicted_next
        assert found.table[:, 0].tolist() == [4] * 16  # rank 4, Tier.VLLM, its blocks
        assert set(found.table[:, 1].tolist()) == {VLLM}
        assert found.table[:, 3].tolist() == list(range(16))
        assert found.lease_ids == (NO_LEASE,) * 16  # vLLM's cache read in place: no lease
        holders.close()
    finally:
        to_child.put("done")
        child.join(30)
    assert child.exitcode == 0


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


def test_holders_take_the_longest_peer_and_only_one_with_every_shard():
    shards = Shards(num_groups=1, tp_size=2)
    held = names(12)
    a0, a1 = Engine(rank=1, tp_rank=0), Engine(rank=1, tp_rank=1)
    b0, b1 = Engine(rank=3, tp_rank=0), Engine(rank=3, tp_rank=1)
    try:
        for tp, e in enumerate((a0, a1)):  # rank 1: 6 blocks in both shards
            e.publish(held[:6], group=shards.directory_group(0, tp))
        b0.publish(held, group=0)  # rank 3: all 12, but only in shard 0 yet
        holders = HostHolders(own_rank=2, shards=shards)
        holders.update([(1, 0, a0.index.path), (1, 1, a1.index.path),
                        (3, 0, b0.index.path), (2, 0, a0.index.path)])  # (own rank: skipped)
        assert holders.ranks == [1]
        found, _ = holders.find(held)
        assert found.num_hits == 6
        assert found.table[:, 2].tolist() == [0] * 6 + [1] * 6  # group-major: both shards
        assert set(found.table[:, 5].tolist()) == {a0.gens.handle()[1], a1.gens.handle()[1]}
        b1.publish(held, group=1)
        holders.update([(1, 0, a0.index.path), (1, 1, a1.index.path),
                        (3, 0, b0.index.path), (3, 1, b1.index.path)])
        found, _ = holders.find(held)
        assert found.num_hits == 12 and set(found.table[:, 0].tolist()) == {3}
        holders.update([(1, 0, a0.index.path), (1, 1, a1.index.path)])  # rank 3 went
        assert holders.ranks == [1] and holders.find(held)[0].num_hits == 6
        assert holders.find(names(3)) is None
        holders.close()
    finally:
        for e in (a0, a1, b0, b1):
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


def test_holders_say_when_the_block_after_the_hit_was_held_here_once():
    """The block after a host hit whose entry moved on (vLLM handed it out: Xavier's tiers
    may hold it now) is worth the directory's answer; one nobody here ever held is not."""
    e = Engine(rank=1)
    try:
        held = names(6)
        e.publish(held)
        e.row[4] += 1  # block 4 handed out again: the hit ends there, its name was seen
        holders = HostHolders(own_rank=2, shards=Shards(1, 1))
        holders.update([(1, 0, e.index.path)])
        found, evicted_next = holders.find(held)
        assert found.num_hits == 4 and evicted_next
        found, evicted_next = holders.find(held[:4] + names(2))
        assert found.num_hits == 4 and not evicted_next
        holders.close()
    finally:
        e.close()


def test_holders_say_which_victims_a_peer_holds_now_in_every_shard_or_held_once():
    """A victim is held elsewhere when one peer holds it live in both TP shards; a peer with
    one shard, a name nobody published, or a block the peer handed out since, is not."""
    shards = Shards(num_groups=2, tp_size=2)
    held = names(6)
    a0, a1 = Engine(rank=1, tp_rank=0), Engine(rank=1, tp_rank=1)
    b0 = Engine(rank=3, tp_rank=0)
    try:
        for tp, e in enumerate((a0, a1)):  # rank 1: names 0-3 in KV group 1, both shards
            e.publish(held[:4], group=shards.directory_group(1, tp))
        b0.publish(held, group=shards.directory_group(1, 0))  # rank 3: one shard only
        holders = HostHolders(own_rank=2, shards=shards)
        holders.update([(1, 0, a0.index.path), (1, 1, a1.index.path),
                        (3, 0, b0.index.path)])
        victims = [(1, n, 100 + i) for i, n in enumerate(held)] + [(0, held[0], 7),
                                                                   (1, names(1)[0], 8)]
        got = holders.holding(victims)
        assert got.now.tolist() == [True] * 4 + [False] * 4
        # (rank 3 announced one shard's index only: not a peer of a TP-2 replica at all)
        assert got.ever.tolist() == [True] * 4 + [False] * 4
        a1.row[2] += 1  # rank 1 handed out its shard-1 copy of name 2 meanwhile
        got = holders.holding(victims[:4])
        assert got.now.tolist() == [True, True, False, True]
        assert got.ever.tolist() == [True] * 4  # (its entry still names it)
        assert holders.holding([]).now.tolist() == []
        holders.close()
        got = HostHolders(own_rank=2, shards=shards).holding(victims)
        assert got.now.sum() == 0 and got.ever.sum() == 0
    finally:
        for e in (a0, a1, b0):
            e.close()


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
