"""CoalescingReleaser: concurrent single releases become one directory call."""

import asyncio

import pytest

from xinference.model.llm.vllm.xavier.block_directory import BlockDirectory
from xinference.model.llm.vllm.xavier.lease_release import CoalescingReleaser


def test_concurrent_releases_make_one_call_and_free_every_lease():
    d = BlockDirectory()
    d.register_rank(1)
    d.register(1, [(0, 100 + i, 0, i, 1) for i in range(512)])
    q = d.query(0, [100 + i for i in range(512)], exclude_rank=2)
    assert d.outstanding_leases == 512
    calls = []

    async def release_ids(ids):
        calls.append(list(ids))
        return d.release(ids)

    async def run():
        r = CoalescingReleaser(release_ids)
        await asyncio.gather(*(r.release(i) for i in q.lease_ids))
        await asyncio.gather(*(r.release(i) for i in ()))
        return r.calls

    assert asyncio.run(run()) == 1
    assert sorted(calls[0]) == sorted(q.lease_ids)
    assert d.outstanding_leases == 0


def test_a_failed_call_fails_every_waiter_of_its_batch_and_the_next_batch_is_separate():
    attempts = []

    async def release_ids(ids):
        attempts.append(list(ids))
        if len(attempts) == 1:
            raise ConnectionError("directory unreachable")

    async def run():
        r = CoalescingReleaser(release_ids)
        first = await asyncio.gather(*(r.release(i) for i in (1, 2, 3)),
                                     return_exceptions=True)
        assert all(isinstance(x, ConnectionError) for x in first)
        await asyncio.gather(r.release(4), r.release(5))

    asyncio.run(run())
    assert attempts == [[1, 2, 3], [4, 5]]


def test_a_cancelled_waiter_does_not_stop_the_call():
    released = []

    async def release_ids(ids):
        await asyncio.sleep(0.01)
        released.extend(ids)

    async def run():
        r = CoalescingReleaser(release_ids)
        t = asyncio.ensure_future(r.release(1))
        other = asyncio.ensure_future(r.release(2))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await other

    asyncio.run(run())
    assert sorted(released) == [1, 2]
