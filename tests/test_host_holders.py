"""The schedulers' view of their host's indexes (mechanism/host_holders.py): a same-host
peer's longest prefix (another process publishes, this one probes; TP shards, the longest
peer, the block after the hit, victims held elsewhere), and a miss answered without a
directory lookup when the whole launch is on this host and no index names the request's
first block -- with each condition that keeps the lookup (a rank elsewhere, an index not
mapped or closed, the block held once) shown to keep it."""

import multiprocessing
import os
from typing import List

from tests.support.host_indexes import VLLM, Engine, names
from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.mechanism.host_holders import HELD_NOWHERE, HostHolders
from xinference.model.llm.vllm.xavier.mechanism.host_index import name_words
from xinference.model.llm.vllm.xavier.planning.load_batch import NO_LEASE, Tier
from xinference.model.llm.vllm.xavier.planning.shards import Shards
from xinference.model.llm.vllm.xavier.planning.shm_words import owned_name, shm_dir


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
                        (3, 0, b0.index.path), (2, 0, a0.index.path)])  # (not rank 2's file)
        assert holders.open_failures == 1
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


def test_a_first_block_no_index_of_the_launch_names_is_held_nowhere():
    """Peer rank 1 and this rank 2 are the whole launch, both on this host: a request
    whose first block neither index names is answered held nowhere; one the peer held
    once (handed out since: its tier may hold it), one this rank's own worker published
    (its own tier may hold it), or one the peer holds now, is not."""
    peer, own = Engine(rank=1), Engine(rank=2)
    try:
        held, own_held = names(4), names(2)
        peer.publish(held)
        own.publish(own_held)
        peer.row[2] += 1  # the peer handed block 2 out again
        holders = HostHolders(own_rank=2, shards=Shards(1, 1))
        holders.update([(1, 0, peer.index.path), (2, 0, own.index.path)], whole_launch=True)
        assert holders.ranks == [1]  # (its own index: for what it ever held, not a peer)
        assert holders.find(names(3)) == (HELD_NOWHERE, False)
        assert holders.find(held[2:]) is None  # held once by the peer
        assert holders.find(own_held) is None  # held by this rank's own worker
        found, evicted_next = holders.find(held)
        assert found.num_hits == 2 and evicted_next
        # the directory's word is needed: without it every miss still asks the directory
        holders.update([(1, 0, peer.index.path), (2, 0, own.index.path)])
        assert holders.find(names(3)) is None
        holders.close()
    finally:
        peer.close()
        own.close()


def test_an_index_not_mapped_or_closed_keeps_the_lookup():
    """An announced index that cannot be opened, or one its owner closed (its engine went;
    the successor's index is not mapped yet), could hide a holder: the miss goes to the
    directory as before."""
    peer, own = Engine(rank=1), Engine(rank=2)
    try:
        missing = os.path.join(shm_dir(), owned_name())  # (an Xavier name, no file)
        holders = HostHolders(own_rank=2, shards=Shards(1, 1))
        holders.update([(1, 0, peer.index.path), (2, 0, own.index.path), (3, 0, missing)],
                       whole_launch=True)
        assert holders.open_failures == 1 and holders.find(names(2)) is None
        holders.update([(1, 0, peer.index.path), (2, 0, own.index.path)], whole_launch=True)
        assert holders.find(names(2)) == (HELD_NOWHERE, False)
        peer.index.close()
        assert holders.find(names(2)) is None
        holders.close()
    finally:
        peer.close()
        own.close()


def test_the_directory_says_whole_launch_only_when_every_rank_announced_every_shard_here():
    tracker = VLLMBlockTracker.__new__(VLLMBlockTracker)
    VLLMBlockTracker.__init__(tracker)
    assert tracker.host_view("h1") == ([], False)  # (no rank yet: nothing to say)
    tracker.register_rank(1, 2)
    tracker.register_rank(2, 2)
    for tp in (0, 1):
        tracker.announce_index(1, tp, "h1", f"/dev/shm/a{tp}")
    tracker.announce_index(2, 0, "h1", "/dev/shm/b0")
    assert tracker.host_view("h1")[1] is False  # rank 2's second worker: not announced
    tracker.announce_index(2, 1, "h1", "/dev/shm/b1")
    announced, whole = tracker.host_view("h1")
    assert whole and announced == [(1, 0, "/dev/shm/a0"), (1, 1, "/dev/shm/a1"),
                                   (2, 0, "/dev/shm/b0"), (2, 1, "/dev/shm/b1")]
    tracker.register_rank(3, 2)  # a replica on another host joins
    for tp in (0, 1):
        tracker.announce_index(3, tp, "h2", f"/dev/shm/c{tp}")
    assert tracker.host_view("h1")[1] is False and tracker.host_view("h2")[1] is False
    tracker.unregister_rank(3)
    assert tracker.host_view("h1")[1] is True
    # a rank known only by a registration of blocks (no announced index): not whole
    tracker.register(4, [(0, 7, int(Tier.VLLM), 0, 0)], 1)
    assert tracker.host_view("h1")[1] is False


def test_an_index_with_room_for_the_tiers_still_names_a_saved_block_later():
    """A block vLLM handed out (saved into a tier, say) stays "seen" -- so a request for it
    still asks the directory -- while the engine publishes its vLLM cache anew eight times
    (2,048 blocks, within the tiers' 4,096), when its index has room for what the tiers
    hold; without that room (the control) its entry is reused and the request would be
    answered held nowhere.  (Names and the index's salt are random: with half as many
    publications the control's entry survived in 2 of 150 tries, CI58.)"""
    seen = {}
    for tier_blocks in (0, 4096):
        e = Engine(rank=1, num_blocks=256, tier_blocks=tier_blocks)
        try:
            saved = names(1)
            e.publish(saved)
            e.row[0] += 1  # handed out: saved into a tier
            for _ in range(16):  # 16 x 128 new blocks published
                e.row[:] += 1
                e.publish(names(64), first_block=0)
                e.publish(names(64), first_block=64)
            seen[tier_blocks] = bool(e.index.find(0, name_words(saved))[2][0])
        finally:
            e.close()
    assert seen == {0: False, 4096: True}
