"""Every read checked after its copy (``mechanism/read_checks.py``): the comparison alone,
then the load engine reading real storages whose identity lives in a real generations file
(``SlotGenerations``), with the check switched off as the negative control."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from xinference.model.llm.vllm.xavier.mechanism.gpu_transfer import GPUTransfer
from xinference.model.llm.vllm.xavier.mechanism.read_checks import SourceIdentity, check_read
from xinference.model.llm.vllm.xavier.mechanism.slot_generations import SlotGenerations
from xinference.model.llm.vllm.xavier.planning.load_batch import BlockLoad, LoadBatch, Tier
from xinference.model.llm.vllm.xavier.planning.plan import SlabConfig, Transfer

from .kvfixtures import BLOCK_DIM, GROUP_SHAPES, block, make_caches

INC = 4242
#: where the loading engine's KV caches live (the sources stay in host memory: a CUDA
#: engine reads them through CUDA views, its check waits for the copy's event)
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")


def transfer(gens, dst_rows=None, inc=INC) -> Transfer:
    n = len(gens)
    rows = np.arange(n) if dst_rows is None else np.asarray(dst_rows)
    return Transfer(1, Tier.GPU, 0, 8, np.arange(10, 10 + n), 100 + np.arange(len(rows)),
                    rows, np.asarray(gens, np.int64), inc)


def test_a_read_holds_only_while_incarnation_and_every_generation_hold():
    t = transfer([3, 4, 5])
    assert check_read(t, SourceIdentity(INC, np.array([3, 4, 5]))).ok
    moved = check_read(t, SourceIdentity(INC, np.array([3, 9, 5])))
    assert moved.failed_rows == 1 and moved.failed_blocks.tolist() == [101]
    assert not moved.stale_mapping
    other = check_read(t, SourceIdentity(INC + 1, np.array([3, 4, 5])))  # same numbers
    assert other.failed_rows == 3 and other.failed_blocks.tolist() == [100, 101, 102]
    assert other.stale_mapping
    # one read feeding two destinations fails both
    fan = check_read(transfer([3, 4], dst_rows=[0, 1, 1]), SourceIdentity(INC, np.array([3, 7])))
    assert fan.failed_blocks.tolist() == [101, 102]
    # nothing to check against: unchecked, not passed
    assert check_read(transfer([3]), None) is None
    bare = Transfer(1, Tier.GPU, 0, 8, np.arange(1), np.arange(1), np.arange(1))
    assert check_read(bare, SourceIdentity(INC, np.array([3]))) is None
    with pytest.raises(ValueError, match="generations: expected 3"):
        check_read(t, SourceIdentity(INC, np.array([3, 4])))


N_SLOTS, N_BLOCKS = 16, 24


class Source:
    """A same-host storage as a peer maps it: its two groups' slots, and its generations
    file (one row per group of its GPU tier), written as the source's writer does: the
    generation bumped before the slot's bytes change."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.caches = make_caches(N_SLOTS, torch.float16, gen)
        self.owner = SlotGenerations.create({(int(Tier.GPU), g): N_SLOTS for g in (0, 1)})
        self.reader = SlotGenerations.open(self.owner.handle())
        for g in (0, 1):
            self.owner.row(int(Tier.GPU), g)[:] = 1
        self._gen = gen

    def overwrite(self, group: int, slot: int) -> None:
        self.owner.row(int(Tier.GPU), group)[slot] += 1
        for layer, (_, dim) in zip(self.caches[group], GROUP_SHAPES[group]):
            block(layer, dim, slot).copy_(torch.randn(block(layer, dim, slot).shape,
                                                      generator=self._gen))

    def close(self) -> None:
        self.reader.close()
        self.owner.close()


def engine(source: Source, validate: bool = True) -> GPUTransfer:
    eng = GPUTransfer(0, SlabConfig(8, 2, 2), validate_reads=validate)
    eng.set_local_caches(make_caches(N_BLOCKS, torch.float16, torch.Generator().manual_seed(9),
                                     DEVICE), BLOCK_DIM)
    eng.map_storage(1, Tier.GPU, source.caches, BLOCK_DIM, generations=source.reader)
    return eng


def rows_of(source: Source, slots, inc=None):
    """Both groups' slot ``s`` into destination ``dest(g, s)``, as the directory promised
    them."""
    inc = source.owner.incarnation if inc is None else inc
    return LoadBatch.from_requests([("r", [
        BlockLoad(g, 500 + s, 1, int(Tier.GPU), s, dest(g, s),
                  int(source.owner.row(int(Tier.GPU), g)[s]), inc)
        for g in (0, 1) for s in slots])])


def dest(group: int, slot: int) -> int:
    return 1 + slot + 10 * group


def loaded_equals_source(eng: GPUTransfer, source: Source, group: int, slot: int) -> bool:
    dst = [t.cpu() for t in eng.local_block_views[group]]
    src = [t.movedim(BLOCK_DIM[group], 0) for t in source.caches[group]]
    return all(torch.equal(as_bytes(d[dest(group, slot)]), as_bytes(s[slot]))
               for d, s in zip(dst, src))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def test_a_slot_overwritten_after_publication_is_a_failed_block_and_switched_off_it_loads():
    """The source reused slot 2 of group 0 between the lookup and the load (its writer
    bumped the generation, then wrote other bytes): with the check that destination is
    reported failed, every other one is loaded and counted as validated; without it the
    other block's bytes are loaded under the old name and nothing says so."""
    for validate in (True, False):
        source = Source(1)
        eng = engine(source, validate)
        try:
            batch = rows_of(source, [1, 2, 3])
            source.overwrite(0, 2)
            res = eng.load_gpu_requests_v1(batch).wait(30)
            c = eng.counters
            if validate:
                assert res.failed == frozenset({3}) and res.blocks_written == 5
                assert (c.reads_validated, c.validation_failures) == (6, 1)
            else:  # negative control: the new bytes sit under the old name, unreported
                assert res.failed == frozenset() and res.blocks_written == 6
                assert (c.reads_validated, c.validation_failures) == (0, 0)
            assert loaded_equals_source(eng, source, 0, 2)  # the copy read the new bytes
            assert all(loaded_equals_source(eng, source, g, s) for g in (0, 1) for s in (1, 3))
        finally:
            eng.close()
            source.close()


def test_rows_of_another_incarnation_fail_whole_and_only_a_gone_storage_is_named_stale():
    """Rows published by another storage than the one mapped: every read fails, though the
    slot numbers and generations match.  While the mapped storage lives (the rows are the
    old ones: an answer older than the source's restart) its mapping is fine and is not
    named stale; once its owner closed it (the file is gone: the mapping outlived its
    storage) the rank is handed out once as stale, for its peer to map it again."""
    source = Source(2)
    eng = engine(source)
    try:
        old_rows = rows_of(source, [1, 2], inc=source.owner.incarnation + 1)
        res = eng.load_gpu_requests_v1(old_rows).wait(30)
        assert res.failed == frozenset({2, 3, 12, 13}) and res.blocks_written == 0
        assert eng.counters.validation_failures == 4 and eng.take_stale_ranks() == set()
        res = eng.load_gpu_requests_v1(rows_of(source, [1, 2])).wait(30)
        assert res.failed == frozenset() and eng.counters.reads_validated == 8
        newer = rows_of(source, [1], inc=source.owner.incarnation + 7)
        source.owner.close()  # the source went: its generations file is removed
        assert eng.load_gpu_requests_v1(newer).wait(30).failed == frozenset({2, 12})
        assert eng.take_stale_ranks() == {1} and eng.take_stale_ranks() == set()
    finally:
        eng.close()
        source.close()


def test_a_storage_whose_identity_cannot_be_read_fails_its_reads_and_one_without_is_counted():
    """A mapping whose generations were closed under it (its identity reads as incarnation
    0), or that has no row for a read's group: nothing read from it is trusted.  A storage
    mapped without generations (tests of the copy path) is read unchecked, and counted."""
    source = Source(3)
    eng = engine(source)
    try:
        batch = rows_of(source, [4])
        source.reader.close()
        res = eng.load_gpu_requests_v1(batch).wait(30)
        assert res.failed == frozenset({5, 15}) and eng.counters.validation_failures == 2
    finally:
        eng.close()
        source.close()
    source = Source(4)
    only_group_0 = SlotGenerations.create({(int(Tier.GPU), 0): N_SLOTS})
    eng = GPUTransfer(0, SlabConfig(8, 2, 2))
    eng.set_local_caches(make_caches(N_BLOCKS, torch.float16, torch.Generator().manual_seed(9),
                                     DEVICE), BLOCK_DIM)
    eng.map_storage(1, Tier.GPU, source.caches, BLOCK_DIM, generations=only_group_0)
    eng.map_storage(2, Tier.GPU, source.caches, BLOCK_DIM)  # no generations at all
    try:
        only_group_0.row(int(Tier.GPU), 0)[:] = 1
        res = eng.load_gpu_requests_v1(
            rows_of(source, [4], inc=only_group_0.incarnation)).wait(30)
        assert res.failed == frozenset({15})  # group 1 has no row: that read fails
        unchecked = LoadBatch.from_requests([("u", [BlockLoad(0, 9, 2, 0, 6, 20, 1, 5)])])
        assert eng.load_gpu_requests_v1(unchecked).wait(30).failed == frozenset()
        snap = eng.sink.snapshot()
        assert (snap["reads_validated"], snap["reads_unchecked"]) == (1, 1)
    finally:
        eng.close()
        only_group_0.close()
        source.close()
