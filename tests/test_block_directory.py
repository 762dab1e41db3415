"""The block directory: prefixes, tiers, leases, claims, stale entries, purges."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from xinference.model.llm.vllm.xavier.planning.block_directory import (
    BlockDirectory,
    DirectoryError,
    Location,
)
from xinference.model.llm.vllm.xavier.planning.directory_entries import location_of, short_name
from xinference.model.llm.vllm.xavier.planning.load_batch import NO_LEASE, Tier

GPU, CPU = 0, 1


def test_longest_prefix_from_other_ranks_with_leases():
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, GPU, 1, 1), (0, 13, GPU, 3, 1)])
    d.register(2, [(0, 10, GPU, 5, 1), (0, 12, CPU, 0, 1)])
    r = d.query(0, [10, 11, 12, 13, 14], exclude_rank=2)
    assert r.keys == (10, 11)  # 12 only on the asking rank: the prefix stops
    assert [loc.rank for loc in r.locations] == [1, 1]
    assert d.outstanding_leases == 2 and d.leased(1, GPU, 0, 0) == 1
    r2 = d.query(0, [10, 11, 12, 13], exclude_rank=3)
    assert r2.keys == (10, 11, 12, 13)
    assert r2.locations[0].rank == 2  # GPU tier on both: the less leased one
    assert r2.locations[2] == Location(2, CPU, 0, 0, 1)
    assert d.release(r.lease_ids + r2.lease_ids) == 6 and d.outstanding_leases == 0


def test_gpu_tier_preferred():
    d = BlockDirectory()
    d.register(1, [(0, 10, CPU, 0, 1)])
    d.register(2, [(0, 10, GPU, 0, 1)])
    assert d.query(0, [10], exclude_rank=0).locations[0].rank == 2


def test_among_many_holders_the_first_unleased_device_copy_is_taken():
    """A common prefix held by 64 replicas (#36: the scan per key stops at the first copy
    nothing is preferred to): a host copy and a leased device copy listed first are passed
    over; the choice is the one the full scan made."""
    d = BlockDirectory()
    d.register(1, [(0, 10, CPU, 0, 1)])
    d.register(2, [(0, 10, GPU, 0, 1)])
    held = d.query(0, [10], exclude_rank=0)  # leases rank 2's copy
    assert held.locations[0].rank == 2
    for rank in range(3, 67):
        d.register(rank, [(0, 10, 2, rank, 1)])  # vLLM's cache read in place (never leased)
    assert d.query(0, [10], exclude_rank=0, lease=False).locations[0].rank == 3
    d.release(held.lease_ids)
    assert d.query(0, [10], exclude_rank=0, lease=False).locations[0].rank == 2


def test_claim_refuses_leased_slots_and_unregisters_granted_ones():
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, GPU, 1, 1)])
    r = d.query(0, [10], exclude_rank=2)
    assert d.claim(1, GPU, 0, [0, 1]) == [1]  # slot 0 is leased
    assert d.stats.claims_refused == 1
    assert d.query(0, [11], exclude_rank=2).num_hits == 0  # claimed: never returned again
    with pytest.raises(DirectoryError, match="^slot: rank 1 tier 0 slot 0 is leased"):
        d.register(1, [(0, 99, GPU, 0, 2)])  # reuse without claim while leased
    d.release(r.lease_ids)
    assert d.claim(1, GPU, 0, [0]) == [0]
    d.register(1, [(0, 99, GPU, 0, 2)])
    assert d.query(0, [10], exclude_rank=2).num_hits == 0
    assert d.query(0, [99], exclude_rank=2).locations[0] == Location(1, GPU, 0, 0, 2)


def test_stale_generation_ignored():
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 5)])
    assert d.register(1, [(0, 11, GPU, 0, 4)]) == 0  # late message about an older use
    assert d.stats.stale_registrations == 1
    assert d.query(0, [10], exclude_rank=2).locations[0].generation == 5


def test_a_restarted_storage_s_rows_replace_the_old_incarnation_s_whatever_their_generation():
    """A source restarted under the same rank numbers its slots anew (generation 1 again)
    without claiming them here: its rows replace the old storage's -- also a leased one,
    whose reader's check then fails (the old incarnation's bytes are gone) -- and are not
    taken for stale; within one incarnation an older generation still is."""
    d = BlockDirectory()
    old, new = 1111, 2222
    d.register(1, [(0, 10, GPU, 0, 5), (0, 11, GPU, 1, 6)], old)
    held = d.query(0, [11], exclude_rank=2)
    assert d.register(1, [(0, 20, GPU, 0, 1), (0, 21, GPU, 1, 1)], new) == 2
    assert d.stats.stale_registrations == 0
    hit = d.query(0, [20, 21], exclude_rank=2)
    assert [(loc.slot, loc.generation, loc.incarnation) for loc in hit.locations] == [
        (0, 1, new), (1, 1, new)]
    assert d.query(0, [10], exclude_rank=2).num_hits == 0  # the old names are gone
    assert d.register(1, [(0, 22, GPU, 0, 0)], new) == 0  # older, same incarnation: stale
    assert d.stats.stale_registrations == 1
    assert d.release(held.lease_ids + hit.lease_ids) == 3 and d.outstanding_leases == 0


def test_unregister_rank_purges_blocks_and_leases():
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, CPU, 0, 1)])
    d.register(2, [(0, 11, GPU, 3, 1)])
    r = d.query(0, [10, 11], exclude_rank=3)
    assert d.unregister_rank(1) == 2
    assert d.query(0, [10], exclude_rank=3).num_hits == 0  # a miss, not an error
    assert d.query(0, [11], exclude_rank=3).locations[0].rank == 2
    assert d.release(r.lease_ids) == 1 and d.stats.unknown_releases == 1
    assert d.outstanding_leases == 1


def test_a_dead_loader_s_leases_go_with_it_and_free_the_source_s_slots():
    """A loader that died between its lookup and its load (killed replica) pinned the
    source's slots for the life of the launch: now unregistering it drops the leases it
    holds, so the source can claim the slots; a late release of one is counted unknown."""
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, GPU, 1, 1)])
    dead = d.query(0, [10, 11], exclude_rank=2)
    alive = d.query(0, [11], exclude_rank=3)
    assert d.claim(1, GPU, 0, [0, 1]) == []  # both leased
    assert d.unregister_rank(2) == 0  # it held blocks of its own: none
    assert d.stats.leases_of_gone_holders == 2 and d.outstanding_leases == 1
    assert d.claim(1, GPU, 0, [0, 1]) == [0]  # rank 3 still holds slot 1
    assert d.release(dead.lease_ids) == 0 and d.stats.unknown_releases == 2
    assert d.release(alive.lease_ids) == 1 and d.outstanding_leases == 0


def test_leases_expire_so_a_lost_release_pins_a_slot_only_for_a_while():
    """A lease whose release never comes (a lost message, a holder stuck) expires after
    ``lease_ttl_s``: the next claim drops it first and may take the slot (the holder's
    late load then fails its check after the copy); a younger lease still holds, and a
    query past ``max_leases`` drops expired leases before it refuses."""
    now = [1000.0]
    d = BlockDirectory(max_leases=3, lease_ttl_s=60.0, clock=lambda: now[0])
    d.register(1, [(0, k, GPU, k, 1) for k in range(4)])
    old = d.query(0, [0, 1], exclude_rank=2)
    now[0] += 30
    young = d.query(0, [2], exclude_rank=2)
    now[0] += 31  # the first two are 61 s old, the third 31 s
    assert d.query(0, [3], exclude_rank=2).num_hits == 1  # past max_leases: expired go first
    assert d.stats.leases_expired == 2 and d.outstanding_leases == 2
    assert d.claim(1, GPU, 0, [0, 1, 2]) == [0, 1]  # slot 2 still held
    assert d.release(old.lease_ids) == 0 and d.release(young.lease_ids) == 1


def test_one_location_per_key_and_rank_newest_wins():
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 1)])
    d.register(1, [(0, 10, CPU, 4, 1)])  # demoted before the GPU slot is claimed
    assert d.num_blocks == 1
    assert d.query(0, [10], exclude_rank=2).locations[0] == Location(1, CPU, 0, 4, 1)


def test_lease_bound_refuses_with_a_miss():
    d = BlockDirectory(max_leases=2)
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, GPU, 1, 1), (0, 12, GPU, 2, 1)])
    assert d.query(0, [10, 11, 12], exclude_rank=2).num_hits == 0
    assert d.query(0, [10, 11], exclude_rank=2).num_hits == 2


@pytest.mark.parametrize("entry, field", [((0, -1, 0, 0, 0), "key"), ((0, 1, 7, 0, 0), "Tier"),
                                          ((0, 1, 0, "x", 0), "slot"), ((0, 1, 0, 0, None), "gen")])
def test_bad_entries_named(entry, field):
    with pytest.raises(ValueError, match=field):
        BlockDirectory().register(1, [entry])


class DirectoryMachine(RuleBasedStateMachine):
    """Random registrations, queries, releases, claims and purges keep the invariants:
    a leased slot is never reused, no query returns a claimed or stale slot, lease counts
    balance, memory stays within the registered slots."""

    SLOTS = 4

    def __init__(self):
        super().__init__()
        self.d = BlockDirectory()
        self.gen = {}  # (rank, tier, slot) -> generation of the storage
        self.content = {}  # (rank, tier, slot) -> key the storage holds there
        self.leases = {}  # lease id -> (rank, tier, slot, generation, holder)

    @rule(rank=st.integers(1, 3), tier=st.integers(0, 2), slot=st.integers(0, SLOTS - 1),
          key=st.integers(1, 8))
    def write(self, rank, tier, slot, key):
        """A storage tier (GPU, CPU) claims a slot before it reuses it; vLLM's cache read in
        place (tier 2) hands a block out without asking: the replica forgets it after."""
        sid = (rank, tier, slot)
        if sid in self.content:
            if tier == Tier.VLLM:
                self.d.forget(rank, tier, {0: [(slot, self.gen[sid] + 1)]})
            elif not self.d.claim(rank, tier, 0, [slot]):
                assert any(v[:3] == sid for v in self.leases.values())
                return
        self.gen[sid] = self.gen.get(sid, 0) + 1
        self.content[sid] = key
        self.d.register(rank, [(0, key, tier, slot, self.gen[sid])])

    @rule(keys=st.lists(st.integers(1, 8), max_size=5), asking=st.integers(0, 3))
    def query(self, keys, asking):
        # the copies the general path (_best_copy, key by key) offers: the query's inline
        # common case must choose exactly these
        expected = []
        for key in keys:
            record = self.d._records.get(short_name(key, 0))
            best = None if record is None else self.d._best_copy(0, key, asking, record)
            if best is None:
                break
            expected.append(best)
        r = self.d.query(0, keys, exclude_rank=asking)
        assert [tuple(loc) for loc in r.locations] == [tuple(location_of(e)) for e in expected]
        assert list(r.keys) == keys[:len(r.keys)]
        for key, loc, lease in zip(r.keys, r.locations, r.lease_ids):
            sid = (loc.rank, loc.tier, loc.slot)
            assert loc.rank != asking
            assert self.content.get(sid) == key and self.gen[sid] == loc.generation
            if loc.tier == Tier.VLLM:
                assert lease == NO_LEASE  # (vLLM reuses its blocks without asking anyone)
            else:
                self.leases[lease] = (*sid, loc.generation, asking)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = data.draw(st.sampled_from(list(self.leases)))  # (grant order: ids are random)
        del self.leases[lease]
        self.d.release([lease])

    @rule(rank=st.integers(1, 3))
    def purge(self, rank):
        self.d.unregister_rank(rank)
        for sid in [s for s in self.content if s[0] == rank]:
            del self.content[sid]
        # the leases on its slots and those it holds go with it
        self.leases = {k: v for k, v in self.leases.items() if rank not in (v[0], v[4])}

    @invariant()
    def balanced(self):
        assert self.d.outstanding_leases == len(self.leases)
        assert self.d.num_blocks <= 3 * 3 * self.SLOTS


TestDirectoryMachine = DirectoryMachine.TestCase
TestDirectoryMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_demotion_registers_the_lower_copy_and_claims_the_upper_slot_in_one_call():
    d = BlockDirectory()
    d.register(1, [(0, 7, 0, 3, 1), (0, 8, 0, 4, 1)])
    held = d.query(0, [8], exclude_rank=2)  # a peer reads key 8 from GPU slot 4
    granted = d.move(1, [(0, 7, 1, 10, 1), (0, 8, 1, 11, 1)], 0, 0, [3, 4])
    assert granted == [3]  # slot 4 is leased: refused, kept
    again = d.query(0, [7, 8], exclude_rank=2)
    assert [(loc.tier, loc.slot) for loc in again.locations] == [(1, 10), (1, 11)]
    d.release(held.lease_ids + again.lease_ids)


def test_a_forged_short_key_collision_is_a_counted_miss():
    """Blocks are found under their full name only: a name with the same low 63 bits as a
    stored block (what a load row carries; forgeable offline with a known seed) finds
    nothing, takes no lease and is counted (#23).  Control: the stored name hits, and an
    unrelated missing name is not counted."""
    d = BlockDirectory()
    name = (12345 << 100) | 777
    forged = (999 << 100) | 777
    d.register(1, [(0, name, 0, 4, 1)])
    miss = d.query(0, [forged], exclude_rank=2)
    assert miss.num_hits == 0 and d.outstanding_leases == 0
    assert d.stats.identity_mismatches == 1
    assert d.query(0, [(5 << 100) | 778], exclude_rank=2).num_hits == 0
    assert d.stats.identity_mismatches == 1  # control: another short key, not counted
    hit = d.query(0, [name], exclude_rank=2)
    assert hit.num_hits == 1 and hit.locations[0].slot == 4
    d.release(hit.lease_ids)
    assert d.claim(1, 0, 0, [4]) == [4]  # the block goes: nothing is left to mismatch
    assert d.query(0, [forged], exclude_rank=2).num_hits == 0
    assert d.stats.identity_mismatches == 1 and d.num_keys == 0


def test_an_answer_crosses_processes_in_its_compact_form_unchanged():
    """Answers go from the directory actor to every scheduler: xoscar's serializer (pickle
    underneath) carries the arrays of ``QueryResult.__reduce__``, and what arrives equals
    what left: 192-bit names, locations (as :class:`Location`), lease ids; empty too."""
    import pickle

    import numpy as np
    from xoscar.serialization import deserialize, serialize

    d = BlockDirectory()
    names = [(1 << 191) | i for i in range(40)] + [7]  # wide names and a small one
    inc = 2**63 - 5  # an incarnation takes 63 bits: it must cross whole
    d.register(1, [(0, k, GPU if i % 2 else CPU, i, 3 + i) for i, k in enumerate(names)], inc)
    hit = d.query_prefix([0], names, exclude_rank=2)
    assert hit.num_hits == len(names)
    for back in (pickle.loads(pickle.dumps(hit)), deserialize(*serialize([hit]))[0]):
        assert back == hit
        assert all(type(loc) is Location for loc in back.locations)
        assert back.locations[1] == Location(1, GPU, 0, 1, 4, inc)
    form = hit.__reduce__()[1]
    assert isinstance(form[1], np.ndarray) and isinstance(form[2], np.ndarray)
    empty = d.query_prefix([0], [12345], exclude_rank=2)
    assert pickle.loads(pickle.dumps(empty)) == empty and empty.num_hits == 0


def test_ranks_of_another_tensor_parallel_degree_are_refused_naming_it():
    d = BlockDirectory()
    d.register_rank(1, tp_size=2)
    d.register_rank(1, tp_size=2)  # the same rank again (an engine restarted)
    with pytest.raises(DirectoryError, match="^tensor_parallel_size: rank 2 runs 1, the other "
                                             "replicas of the launch 2"):
        d.register_rank(2)
    d.register_rank(2, tp_size=2)
    d.unregister_rank(1)
    d.unregister_rank(2)
    d.register_rank(3, tp_size=4)  # no rank of the old degree left: accepted


def test_a_recreated_directory_hands_out_no_lease_id_of_the_old_one():
    """A reader that held a lease of the old incarnation (the supervisor's directory actor
    was re-created) releases it late: that must free no lease of the new incarnation (with
    ids restarting at 1 it freed another replica's lease of the same id, and the source
    then reused the slot under that replica's load)."""
    old = BlockDirectory()
    old.register(0, [(0, 7, 0, 3, 1)])
    held = old.query(0, [7], exclude_rank=1).lease_ids
    new = BlockDirectory()
    new.register(0, [(0, 7, 0, 3, 1)])
    live = new.query(0, [7], exclude_rank=2).lease_ids
    assert len(held) == len(live) == 1 and not set(held) & set(live)
    assert new.release(held) == 0 and new.stats.unknown_releases == 1
    assert new.claim(0, 0, 0, [3]) == []  # the live lease still protects the slot
    assert all(0 < i < 2 ** 63 for i in held + live)


VLLM = 2


def test_a_block_held_in_a_ranks_own_vllm_cache_is_offered_without_a_lease():
    """vLLM's cache read in place: vLLM reuses its blocks without asking anyone, so a
    lease would protect nothing (the reader's check after its copy does); the answer
    carries NO_LEASE and releasing it is a no-op, not an unknown id."""
    from xinference.model.llm.vllm.xavier.planning.load_batch import NO_LEASE

    d = BlockDirectory(max_leases=1)
    d.register(1, [(0, 10, VLLM, 7, 3), (0, 11, VLLM, 8, 3)], incarnation=5)
    d.register(2, [(0, 10, CPU, 0, 1)])
    r = d.query(0, [10, 11], exclude_rank=3)
    # device memory (rank 1's vLLM cache) before rank 2's CPU tier; max_leases=1 does
    # not refuse two in-place hits
    assert r.locations == (Location(1, VLLM, 0, 7, 3, 5), Location(1, VLLM, 0, 8, 3, 5))
    assert r.lease_ids == (NO_LEASE, NO_LEASE) and d.outstanding_leases == 0
    assert d.release(r.lease_ids) == 0 and d.stats.unknown_releases == 0
    assert d.stats.leases_granted == 0


def test_forget_drops_a_ranks_in_place_entries_whatever_their_generation():
    d = BlockDirectory()
    d.register(1, [(0, 10, VLLM, 7, 3), (1, 10, VLLM, 7, 3), (0, 11, VLLM, 8, 4)])
    d.register(2, [(0, 10, GPU, 0, 1)])
    # (slot, its generation now): block 9 was never listed
    assert d.forget(1, VLLM, {0: [(7, 4), (9, 1)], 1: [(7, 4)]}) == 2
    assert d.query(0, [10], exclude_rank=3).locations == (Location(2, GPU, 0, 0, 1, 0),)
    assert d.query(0, [11], exclude_rank=3).num_hits == 1
    assert d.query(1, [10], exclude_rank=3).num_hits == 0
    assert d.stats.forgotten == 2
    # the publication of generation 3 arriving after the forget is refused as stale; the
    # slot's next publication is taken
    assert d.register(1, [(0, 10, VLLM, 7, 3)]) == 0 and d.stats.stale_registrations == 1
    assert d.register(1, [(0, 12, VLLM, 7, 4)]) == 1
    # an engine gone: every in-place entry of its rank goes (its snapshot tiers stay)
    d.register(1, [(0, 13, CPU, 5, 1)])
    assert d.forget(1, VLLM) == 2 and d.query(0, [13], exclude_rank=3).num_hits == 1


def test_a_late_forget_keeps_the_block_registered_in_its_slot_since():
    """The scheduler forgets a handed-out block (its slot's generation now) from vLLM's
    scheduling loop; the worker registers the block vLLM computed there after the forward,
    from another process, over another connection -- and a busy directory can take that
    first (the scheduler keeps one forget call out at a time).  The late forget drops only
    what is older than the generation it names; a forget arriving later still (an older
    generation) neither drops the newer block nor lowers the stale floor."""
    d = BlockDirectory()
    d.register(1, [(0, 10, VLLM, 5, 1), (0, 11, VLLM, 6, 1)])
    d.register(1, [(0, 20, VLLM, 5, 2)])  # slot 5 handed out and filled again: first
    assert d.forget(1, VLLM, {0: [(5, 2), (6, 2)]}) == 1  # only block 11 (slot 6) goes
    assert d.query(0, [20], exclude_rank=3).locations == (Location(1, VLLM, 0, 5, 2, 0),)
    assert d.query(0, [11], exclude_rank=3).num_hits == 0
    d.register(1, [(0, 30, VLLM, 5, 3)])
    assert d.forget(1, VLLM, {0: [(5, 2)]}) == 0  # an older forget, later still: kept
    assert d.query(0, [30], exclude_rank=3).num_hits == 1
    assert d.forget(1, VLLM, {0: [(5, 4)]}) == 1
    assert d.register(1, [(0, 30, VLLM, 5, 3)]) == 0  # below the floor: stale


def test_a_loader_leases_its_reads_when_it_allocates_them_and_only_what_still_holds():
    """A lookup can answer without leases (``lease=False``: a request waiting in vLLM's
    queue pins nothing); the loader leases the locations it reads when vLLM allocated the
    destinations (``lease``, one id per location).  No lease for vLLM's cache read in
    place, for a slot reused or forgotten since the answer, for a rank gone; past
    ``max_leases`` none at all (the reads are still checked).  The holder is recorded: a
    dead loader's leases go with it."""
    from xinference.model.llm.vllm.xavier.planning.load_batch import NO_LEASE

    d = BlockDirectory(max_leases=4)
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, CPU, 1, 1), (0, 12, GPU, 2, 1)])
    d.register(3, [(0, 13, VLLM, 7, 3)])
    answer = d.query_many([0], [[10, 11, 12]], exclude_rank=2, lease=False)[0]
    assert answer.num_hits == 3 and answer.lease_ids == (NO_LEASE,) * 3
    assert d.outstanding_leases == 0
    in_place = d.query(0, [13], exclude_rank=2, lease=False).locations[0]
    d.register(1, [(0, 14, GPU, 2, 2)])  # slot 2 reused meanwhile
    ids = d.lease(2, list(answer.locations) + [in_place])
    assert ids[0] != NO_LEASE and ids[1] != NO_LEASE
    assert ids[2:] == [NO_LEASE, NO_LEASE]  # reused slot; read in place
    assert d.outstanding_leases == 2 and d.claim(1, GPU, 0, [0]) == []  # held
    d.unregister_rank(2)  # the loader dies: its leases go, the slot can be reused
    assert d.outstanding_leases == 0 and d.claim(1, GPU, 0, [0]) == [0]
    assert d.lease(2, [answer.locations[0]]) == [NO_LEASE]  # claimed: no longer holds
    d.unregister_rank(1)
    assert d.lease(2, [answer.locations[1]]) == [NO_LEASE]  # its rank is gone
    d.register(1, [(0, k, GPU, k, 1) for k in range(5)])
    locs = d.query(0, list(range(5)), exclude_rank=2, lease=False).locations
    assert d.lease(2, locs) == [NO_LEASE] * 5  # past max_leases: none
    assert d.stats.leases_refused == 5 and d.outstanding_leases == 0
    with pytest.raises(DirectoryError, match="^holder: "):
        d.lease(-3, locs)


def test_a_departed_ranks_copies_are_never_offered_and_leave_their_records():
    """Unregistering a rank (or forgetting a whole tier) drops its places at once and leaves
    its entries as garbage swept later (#36: a rank of 100k blocks held the actor ~0.2 s):
    before the sweep no lookup offers them, a rank of the same number registered again is
    offered only for what it registered anew (the same block in the same slot too, which
    the sweep must not take out), and after it nothing of the old rank is left."""
    from xinference.model.llm.vllm.xavier.planning import block_directory

    d = BlockDirectory()
    keys = [(1 << 150) | k for k in range(3 * block_directory.SWEEP_PER_CALL)]
    d.register(1, [(0, k, GPU, i, 1) for i, k in enumerate(keys)], incarnation=5)
    d.register(2, [(0, keys[0], CPU, 0, 1)])
    assert d.unregister_rank(1) == len(keys) and d.num_blocks == 1
    assert d._garbage  # left to sweep: the call did a bounded part of the work
    assert d.query(0, keys[:1], exclude_rank=3).locations == (Location(2, CPU, 0, 0, 1),)
    assert d.query(0, keys[1:2], exclude_rank=3).num_hits == 0
    # back under the same rank number: the same block in the same slot, another elsewhere
    d.register(1, [(0, keys[1], GPU, 1, 1), (0, keys[5], GPU, 9, 2)], incarnation=6)
    assert d.query(0, keys[4:6], exclude_rank=3).num_hits == 0  # keys[4]: the old rank's
    assert d.query(0, keys[5:6], exclude_rank=3).locations == (Location(1, GPU, 0, 9, 2, 6),)
    d.sweep(-1)
    assert d.query(0, keys[1:2], exclude_rank=3).locations == (Location(1, GPU, 0, 1, 1, 6),)
    assert d.num_keys == 3 and d.num_blocks == 3  # keys[0] (rank 2), keys[1], keys[5]
    assert d.forget(1, GPU) == 2 and d.num_keys == 1
    assert d.stats.identity_mismatches == 0


def test_a_field_too_large_for_an_entry_is_refused_naming_it():
    d = BlockDirectory()
    for entry, field in (((0, 1 << 192, GPU, 0, 1), "key"), ((1 << 16, 1, GPU, 0, 1), "group"),
                         ((0, 1, GPU, 1 << 32, 1), "slot"),
                         ((0, 1, GPU, 0, 1 << 64), "generation")):
        with pytest.raises(DirectoryError, match=f"^{field}: at most"):
            d.register(1, [entry])
    with pytest.raises(DirectoryError, match="^rank: at most"):
        d.register(1 << 16, [(0, 1, GPU, 0, 1)])
    with pytest.raises(DirectoryError, match="^tier: expected a non-negative int"):
        d.register(1, [(0, 1, True, 0, 1)])  # (a bool is no tier)
    assert d.num_blocks == 0
    from xinference.model.llm.vllm.xavier.planning.load_batch import Tier

    assert d.register(1, [(0, 1, Tier.CPU, 0, 1)]) == 1  # a Tier member is one


def test_a_lease_id_cannot_be_guessed_from_ones_own():
    """Another replica's lease is freed only by its id: with ids counted up from a random
    start (before #36), a holder who knew its own id freed its neighbour's by trying the
    ids next to it, and the source could then reuse the slot under the neighbour's load."""
    d = BlockDirectory()
    d.register(1, [(0, 10, GPU, 0, 1), (0, 11, GPU, 1, 1)])
    mine = d.query(0, [10], exclude_rank=2).lease_ids[0]
    theirs = d.query(0, [11], exclude_rank=3)
    assert d.release([mine + i for i in range(-1000, 1001) if i]) == 0
    assert d.outstanding_leases == 2 and d.claim(1, GPU, 0, [1]) == []
    assert d.release(theirs.lease_ids) == 1
