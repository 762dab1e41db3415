"""Reads from another host land in staging rows: a fetch whose caller gave up (the worker's
call timed out) must never write into the rows that the next fetch returns.

The loader is the real ``TransferActor`` (in this process, so that the guards can be
switched off for the negative controls); its sources are ``LateWritingSource`` actors in
sub pools of their own, whose ``copy_to`` still writes after the cancellation (the fault:
``tests/support/late_sources.py``); the bytes move with xoscar's real sockets channel.  The
worker's view is what it would copy into its KV cache: the rows of the set that
``fetch_blocks`` names, read when the call returned.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Dict, Iterator, List, Tuple

import pytest
import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.mechanism import remote_fetch
from xinference.model.llm.vllm.xavier.mechanism.kv_schema import layout_of
from xinference.model.llm.vllm.xavier.mechanism.remote_fetch import (
    StagingBusyError,
    StagingSets,
)
from xinference.model.llm.vllm.xavier.mechanism.snapshot_storage import open_shm
from xinference.model.llm.vllm.xavier.planning.load_batch import Tier
from xinference.model.llm.vllm.xavier.planning.options import (
    XavierOptions,
    transfer_actor_uid,
)
from xinference.model.llm.vllm.xavier.transfer import TransferActor

from .support.late_sources import LateWritingSource
from .support.loop_thread import LoopThread, enter, leave
from .support.pools import actor_pool, sub_pool_addresses

LAYOUT = layout_of({0: [torch.zeros(4, 2, 16, 8), torch.zeros(4, 2, 16, 8)]})
BLOCK_BYTES = LAYOUT.groups[0].layers[0].block_bytes  # per layer
SLOTS = [0, 1, 2, 3]
#: the worker gives up on the first fetch after this long (CALL_TIMEOUT_S, shortened)
GIVE_UP_S = 0.5
OLD, NEW = 0x11, 0x22


def test_staging_sets_hold_one_set_per_running_fetch_and_refuse_a_third():
    sets = StagingSets(LAYOUT, 4)
    try:
        with sets.taken() as first:
            with sets.taken() as second:  # the first one's caller gave up
                assert (first, second) == (0, 1) and sets.overlaps == 1
                with pytest.raises(StagingBusyError, match="all 2 staging row sets"):
                    with sets.taken():
                        pass
            with sets.taken() as again:  # the second set is free again, no third made
                assert again == 1
        with sets.taken() as alone:
            assert alone == 0 and sets.overlaps == 2
        assert sets.handles(1) and sets.rows(1, 0, 2)[0].shape == (2, BLOCK_BYTES)
        with pytest.raises(IndexError, match="staging set 2: 2 allocated"):
            sets.handles(2)
    finally:
        sets.close()
        sets.close()  # idempotent


@pytest.fixture(scope="module")
def pools() -> Iterator[Tuple[LoopThread, str, List[str]]]:
    """One main pool (this process) and two sub pools for every test of the module, on a
    loop of their own: ``(loop, main address, sub pool addresses)``."""
    loop = LoopThread()
    cm = actor_pool(n_process=2)
    pool = loop.run(enter(cm))
    try:
        yield loop, pool.external_address, sub_pool_addresses(pool)
    finally:
        loop.run(leave(cm))
        loop.stop()


@contextlib.asynccontextmanager
async def loader_world(main: str, subs: List[str], late_mode: str
                       ) -> AsyncIterator[Tuple[Any, Any, Dict[str, Any]]]:
    """Rank 2's real transfer actor in this process; rank 1 (another host, a source that
    writes late as ``late_mode`` says) and rank 3 (another host: writes at once, then has
    rank 1 write its late block, then answers) in sub pools.  Every actor goes at the
    end."""
    tracker = await xo.create_actor(VLLMBlockTracker, address=main,
                                    uid=f"{VLLMBlockTracker.default_uid()}-late-{late_mode}")
    world = [main, subs[0], main, subs[1]]
    loader = await xo.create_actor(TransferActor, 2, 4, main, "127.0.0.1", 0, world,
                                   address=main, uid=transfer_actor_uid(2))
    late = await xo.create_actor(LateWritingSource, OLD, late_mode, BLOCK_BYTES,
                                 address=subs[0], uid=transfer_actor_uid(1))
    fast = await xo.create_actor(LateWritingSource, NEW, "fast", BLOCK_BYTES, late,
                                 address=subs[1], uid=transfer_actor_uid(3))
    try:
        options = XavierOptions(rank=2, rank_address=main, block_tracker_address=main,
                                block_tracker_uid=tracker.uid, gpu_budget_bytes=0,
                                cpu_budget_bytes=8 * BLOCK_BYTES, transport="sockets",
                                slab_blocks=len(SLOTS))
        desc = await loader.register_engine(LAYOUT, options, owner=1, device="cpu")
        yield loader, late, desc
    finally:
        for actor in (loader, late, fast, tracker):
            await xo.destroy_actor(actor)


async def timed_out_then_next(loader: Any, late: Any, old_call_ended: bool
                              ) -> Tuple[int, List[torch.Tensor]]:
    """The worker's two fetches: it gives up on the first, from rank 1, after
    ``GIVE_UP_S`` and cancels it without waiting (as ``ActorBridge.call`` does:
    ``fut.cancel()``); the next one, from rank 3, returns.  ``old_call_ended``: the next
    fetch starts only once the first call ended in the loader.  Returns the row set the
    next fetch named and, per layer, the rows the worker then copies (read when it
    returned)."""
    first = asyncio.ensure_future(loader.fetch_blocks(1, int(Tier.CPU), 0, SLOTS))
    await late.wait_entered()  # rank 1 holds the call (its first one maps the peer first)
    done, _ = await asyncio.wait({first}, timeout=GIVE_UP_S)
    assert not done  # the worker gives up
    first.cancel()
    if old_call_ended:
        with contextlib.suppress(asyncio.CancelledError):
            await first
    served, index = await loader.fetch_blocks(3, int(Tier.CPU), 0, SLOTS)
    assert served.bytes == len(SLOTS) * BLOCK_BYTES * 2
    handles = await loader.staging_handles(0, index)
    rows = [t[:len(SLOTS)].clone() for t in open_shm(handles)[0]]
    with contextlib.suppress(asyncio.CancelledError):
        await first
    return index, rows


def filled_with(rows: List[torch.Tensor], byte: int) -> bool:
    return all(bool((r == byte).all()) for r in rows)


def test_a_block_landing_while_the_timed_out_fetch_runs_never_reaches_the_next_fetch(
        pools, monkeypatch):
    """Rank 1's block of the cancelled fetch lands while that call still runs: the next
    fetch got the second row set and the worker copies rank 3's bytes; the late block
    really landed, in the first set.  Negative control: with one set for both (the guard
    off), the worker copies rank 1's bytes as rank 3's."""

    loop, main, subs = pools

    async def run() -> None:
        async with loader_world(main, subs, "while_running") as (loader, late, desc):
            index, rows = await timed_out_then_next(loader, late, old_call_ended=False)
            assert index == 1 and filled_with(rows, NEW)
            # the old call has ended (awaited above): its late block landed in set 0
            first = [t[:len(SLOTS)] for t in open_shm(desc["staging"])[0]]
            assert filled_with(first, OLD)
            stats = await loader.counters()
            assert {k: stats.get(k) for k in ("remote_fetches", "remote_fetch_overlaps",
                                              "peers_mapped_sockets")} == {
                "remote_fetches": 1, "remote_fetch_overlaps": 1, "peers_mapped_sockets": 2}

            with monkeypatch.context() as guard_off:
                guard_off.setattr(StagingSets, "_acquire", lambda self: 0)
                index, rows = await timed_out_then_next(loader, late, old_call_ended=False)
            assert index == 0 and filled_with(rows, OLD)  # wrong KV, silently

    loop.run(run())


def test_a_block_landing_after_the_timed_out_fetch_ended_is_refused(pools, monkeypatch):
    """Rank 1's block of the cancelled fetch reaches the loader's pool after that call
    ended, while the next fetch (which reused the first row set) waits for its answer: the
    block was refused (the old call's buffer refs were forgotten), so the worker copies
    rank 3's bytes.  Negative control: refs not forgotten
    and their rows kept alive (as xoscar may keep them, with the cancelled call's
    traceback: trial 3 of doc/results/xoscar-late-write/out.txt wrote 4.7 ms after the
    call raised), the late block is written into the rows the worker copies."""

    loop, main, subs = pools

    async def run() -> None:
        async with loader_world(main, subs, "after_end") as (loader, late, _):
            index, rows = await timed_out_then_next(loader, late, old_call_ended=True)
            assert index == 0 and filled_with(rows, NEW)
            assert await late.outcome() == "answered"  # it arrived, and changed nothing

            kept: List[Any] = []

            def keep(refs: Any) -> None:
                kept.extend(xo.core.BufferRef.get_buffer(r) for r in refs)

            with monkeypatch.context() as guard_off:
                guard_off.setattr(remote_fetch, "forget_buffer_refs", keep)
                index, rows = await timed_out_then_next(loader, late, old_call_ended=True)
            assert index == 0 and filled_with(rows, OLD)  # wrong KV, silently
            assert await late.outcome() == "answered"

    loop.run(run())


def test_a_fetch_whose_blocks_did_not_land_fails_instead_of_returning_other_bytes(
        pools, monkeypatch):
    """A source whose blocks the loader's pool cannot write (numpy rows into torch rows:
    a ``TypeError`` there) still answers with its byte count, because xoscar's sockets
    ``copy_to`` drops the receiving pool's error: the loader counts the rows written and
    fails the fetch (the load is recomputed).  Negative control: without the count, the
    fetch returns and the worker would copy whatever the rows held before."""

    loop, main, subs = pools

    async def run() -> None:
        source = await xo.create_actor(LateWritingSource, NEW, "fast", BLOCK_BYTES, None,
                                       True, address=subs[0], uid="numpy-source")
        try:
            rows = [torch.zeros((len(SLOTS), BLOCK_BYTES), dtype=torch.uint8)
                    for _ in range(2)]
            with pytest.raises(remote_fetch.IncompleteFetchError,
                               match=r"rows written per layer \[0, 0\], expected 4 each"):
                await remote_fetch.fetch_into(source, main, int(Tier.CPU), 0, SLOTS, rows)
            with monkeypatch.context() as count_off:  # every address counts as NIXL's
                count_off.setattr(remote_fetch, "NIXL_SCHEME", "")
                n = await remote_fetch.fetch_into(source, main, int(Tier.CPU), 0, SLOTS, rows)
            assert n.bytes == len(SLOTS) * BLOCK_BYTES * 2 and filled_with(rows, 0)  # silently
        finally:
            await xo.destroy_actor(source)

    loop.run(run())
