"""The rank registry on real xoscar pools: a rank whose process dies (its worker or host
went away; Xinference tells Xavier nothing then) is found by the manager's liveness checks
and unregistered: its blocks leave the directory and the remaining ranks get the new
world.  A rank that stays alive is never dropped (negative control)."""

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import xoscar as xo

from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker, drop_leftover_actors
from xinference.model.llm.vllm.xavier.collective_manager import (
    CollectiveManager,
    Rank0TransferActor,
)
from xinference.model.llm.vllm.xavier.planning.options import transfer_actor_uid

from .support.pools import actor_pool, sub_pool_addresses
from .support.probe_actor import OverlayProbeActor

MODEL_UID = "liveness-model"
INTERVAL_S = 0.5
TIMEOUT_S = 5.0


def test_dead_rank_is_unregistered_and_its_blocks_leave_the_directory():
    async def run():
        # Xinference's worker pool: a killed sub pool comes back without its actors (with
        # xoscar's default, "actor", the rank's actor would be created again and could
        # answer before two checks missed it: the flaky run of session 14)
        async with actor_pool(n_process=2, auto_recover="process") as pool:
            tracker = await xo.create_actor(
                VLLMBlockTracker, address=pool.external_address,
                uid=f"{VLLMBlockTracker.default_uid()}-{MODEL_UID}")
            # checks every 0.5 s, each judged 5 s after its start, late answers counted: a
            # live rank on a busy machine is never silent that long (the negative control), a
            # dead one answers nothing (connection refused, or no such actor once its process
            # is back)
            manager = await xo.create_actor(
                CollectiveManager, MODEL_UID, liveness_interval_s=INTERVAL_S,
                liveness_timeout_s=TIMEOUT_S,
                address=pool.external_address,
                uid=f"{CollectiveManager.default_uid()}-{MODEL_UID}")
            addresses = sub_pool_addresses(pool)
            # before any rank registers: the probe's first call imports the overlay in rank
            # 1's process (seconds on a busy machine, during which that process answers
            # nothing: a rank there would rightly be dropped)
            probe = await xo.create_actor(OverlayProbeActor, address=addresses[0],
                                          uid="probe-1")
            pid = (await probe.where())["pid"]
            ranks = {}
            for rank, address in zip((1, 2), addresses):
                ranks[rank] = await xo.create_actor(
                    Rank0TransferActor, rank=rank, address=address,
                    uid=transfer_actor_uid(rank))
                await manager.register_rank(rank, address)
                await tracker.register_rank(rank)
                await tracker.register(rank, [(0, 1000 * rank + i, 0, i, 1) for i in range(8)])
            assert (await tracker.stats())["blocks"] == 16

            # both alive for several rounds: nobody is dropped
            await asyncio.sleep(6 * INTERVAL_S)
            assert (await manager.liveness())["ranks"] == [1, 2]
            assert (await manager.liveness())["dropped_unreachable"] == 0
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while (await manager.liveness())["ranks"] != [2]:
                assert time.monotonic() - t0 < 30, await manager.liveness()
                await asyncio.sleep(0.1)
            dropped_after = time.monotonic() - t0
            print(f"rank 1 dropped {dropped_after:.1f} s after its process was killed")
            assert (await manager.liveness())["dropped_unreachable"] == 1
            stats = await tracker.stats()
            assert stats["blocks"] == 8  # rank 2's only
            assert (await tracker.query(0, [1000 + i for i in range(8)])).num_hits == 0
            assert (await tracker.query(0, [2000 + i for i in range(8)])).num_hits == 8
            # the survivor was told: rank 1 has no address any more
            assert (await ranks[2].world()) == ["", "", addresses[1]]
            await xo.destroy_actor(manager)

    asyncio.run(run())


def test_actors_left_by_a_failed_termination_are_dropped_before_a_new_launch():
    """Xinference 3.5.0 skips its Xavier cleanup when a termination meets a dead worker;
    the launch hook destroys the leftovers of a uid that is not running (and, the negative
    control, nothing of a uid that is)."""
    async def run():
        async with actor_pool(n_process=0) as pool:
            await xo.create_actor(VLLMBlockTracker, address=pool.external_address,
                                  uid=f"{VLLMBlockTracker.default_uid()}-{MODEL_UID}")
            await xo.create_actor(CollectiveManager, MODEL_UID, address=pool.external_address,
                                  uid=f"{CollectiveManager.default_uid()}-{MODEL_UID}")
            running = SimpleNamespace(address=pool.external_address,
                                      _model_uid_to_replica_info={MODEL_UID: object()},
                                      _block_tracker_mapping={}, _collective_manager_mapping={})
            assert await drop_leftover_actors(running, MODEL_UID) == 0
            gone = SimpleNamespace(address=pool.external_address, _model_uid_to_replica_info={},
                                   _block_tracker_mapping={MODEL_UID: "stale"},
                                   _collective_manager_mapping={MODEL_UID: "stale"})
            assert await drop_leftover_actors(gone, MODEL_UID) == 2
            assert gone._block_tracker_mapping == {} == gone._collective_manager_mapping
            assert await drop_leftover_actors(gone, MODEL_UID) == 0
            # the uid can be created again: a new launch goes through
            await xo.create_actor(VLLMBlockTracker, address=pool.external_address,
                                  uid=f"{VLLMBlockTracker.default_uid()}-{MODEL_UID}")

    asyncio.run(run())


class StuckWorldRank(Rank0TransferActor):
    """A rank that answers its liveness checks but whose world updates do not come back
    (a host whose link drops the replies), until :meth:`unstick`."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank=rank)
        self._stuck = True

    async def update_world(self, world_addresses):
        while self._stuck:
            await asyncio.sleep(0.05)
        self.world_addresses = list(world_addresses)

    def unstick(self) -> None:
        self._stuck = False


def test_a_rank_whose_world_update_hangs_holds_no_one_up_and_gets_the_world_later():
    """A recovery's world update to a rank that never answers it is bounded by the
    liveness timeout: the registration returns, the other ranks have the new world, and the
    hung rank gets it once it answers again.  Negative control: with the bound far away
    (30 s) the same registration is still waiting after 3 s -- the hang is real."""
    async def run():
        async with actor_pool(n_process=0) as pool:
            addr = pool.external_address
            ranks = {1: await xo.create_actor(Rank0TransferActor, rank=1, address=addr,
                                              uid=transfer_actor_uid(1)),
                     2: await xo.create_actor(StuckWorldRank, 2, address=addr,
                                              uid=transfer_actor_uid(2)),
                     3: await xo.create_actor(Rank0TransferActor, rank=3, address=addr,
                                              uid=transfer_actor_uid(3))}
            slow = await xo.create_actor(CollectiveManager, "hung-slow", liveness_interval_s=60,
                                         liveness_timeout_s=30, address=addr,
                                         uid=f"{CollectiveManager.default_uid()}-hung-slow")
            for rank in (1, 2):
                await slow.register_rank(rank, addr)
            try:
                await asyncio.wait_for(slow.register_rank(3, addr, update=True), 3)
                raise AssertionError("the update returned although rank 2 never answered")
            except asyncio.TimeoutError:
                pass  # the negative control: without a near bound, the recovery hangs

            manager = await xo.create_actor(CollectiveManager, "hung", liveness_interval_s=0.5,
                                            liveness_timeout_s=1.0, address=addr,
                                            uid=f"{CollectiveManager.default_uid()}-hung")
            for rank in (1, 2):
                await manager.register_rank(rank, addr)
            t0 = time.monotonic()
            await manager.register_rank(3, addr, update=True)
            assert time.monotonic() - t0 < 10  # one timeout (1 s), not the hang
            world = await manager.world()
            assert world == ["", addr, addr, addr]
            assert await ranks[1].world() == world and await ranks[3].world() == world
            live = await manager.liveness()
            assert live["behind"] == [2] and live["ranks"] == [1, 2, 3]
            await ranks[2].unstick()
            t0 = time.monotonic()
            while (await manager.liveness())["behind"]:
                assert time.monotonic() - t0 < 20, await manager.liveness()
                await asyncio.sleep(0.1)
            assert await ranks[2].world() == world
            assert (await manager.liveness())["world_updates_retried"] >= 1
            for m in (manager, slow):
                await xo.destroy_actor(m)

    asyncio.run(run())


class SlowOrDarkRank(Rank0TransferActor):
    """A rank whose liveness answers take ``delay_s`` (a busy but live rank), and that can
    go dark: its checks then never answer (a blackholed host: no refusal, no reset)."""

    def __init__(self, rank: int, delay_s: float) -> None:
        super().__init__(rank=rank)
        self._delay_s = delay_s
        self._dark = False

    async def is_ready(self) -> bool:
        await asyncio.sleep(self._delay_s)
        while self._dark:
            await asyncio.sleep(0.01)
        return True

    async def world(self) -> list:
        while self._dark:
            await asyncio.sleep(0.01)
        return list(self.world_addresses)

    def go_dark(self) -> None:
        self._dark = True

    def light_up(self) -> None:
        self._dark = False


class LateAnswersIgnored(CollectiveManager):
    """The control: a check answered after its timeout counts as no answer."""

    async def _ask(self, key, ref):
        asked = time.monotonic()
        try:
            await asyncio.wait_for(ref.is_ready(), self._interval + self._timeout)
        except Exception:
            pass
        else:
            self._heard_any = time.monotonic()  # (heard, but too late to count)
            if key in self._answered and self._heard_any - asked <= self._timeout:
                self._answered[key] = self._heard_any
        finally:
            self._asking.pop(key, None)


def test_a_dark_rank_leaves_within_two_intervals_and_a_slow_one_stays():
    """Checks start on a fixed cadence and are judged their timeout later, but an answer
    that comes late still counts: a rank that answers every check after 1.75 timeouts stays
    registered for many rounds (the control: with late answers ignored both are dropped),
    while one that goes dark is dropped within ``LIVENESS_MISSES`` intervals plus the
    timeout (#36: a blackholed host leaves the directory in about 11 s by default), and is
    taken back once it answers again (it was alive).  While no rank answers at all (this
    side cut off), nobody is dropped."""
    interval, timeout = 0.5, 0.2

    async def run():
        async with actor_pool(n_process=0) as pool:
            addr = pool.external_address
            control = await xo.create_actor(LateAnswersIgnored, "strict",
                                            liveness_interval_s=interval,
                                            liveness_timeout_s=timeout, address=addr,
                                            uid=f"{CollectiveManager.default_uid()}-strict")
            tracker = await xo.create_actor(VLLMBlockTracker, address=addr,
                                            uid=f"{VLLMBlockTracker.default_uid()}-dark")
            manager = await xo.create_actor(CollectiveManager, "dark",
                                            liveness_interval_s=interval,
                                            liveness_timeout_s=timeout, address=addr,
                                            uid=f"{CollectiveManager.default_uid()}-dark")
            ranks = {r: await xo.create_actor(SlowOrDarkRank, r, 1.75 * timeout, address=addr,
                                              uid=transfer_actor_uid(r)) for r in (1, 2)}
            for rank in ranks:
                await ranks[rank].update_world(["", addr, addr])  # (as their start gives it)
                await manager.register_rank(rank, addr)
                await control.register_rank(rank, addr)
                await tracker.register_rank(rank)
                await tracker.register(rank, [(0, 1000 * rank + i, 0, i, 1) for i in range(4)])
            await asyncio.sleep(8 * interval)  # both slow, both live: nobody dropped
            live = await manager.liveness()
            assert live["ranks"] == [1, 2] and live["dropped_unreachable"] == 0, live
            strict = await control.liveness()  # the control: late answers ignored
            # (dropped: both; each answers its world at once, so each is taken back and
            # dropped again at the next late check)
            assert strict["dropped_unreachable"] >= 2, strict
            await xo.destroy_actor(control)

            # every rank silent (as when this side is cut off): no verdict, nobody dropped
            for rank in ranks.values():
                await rank.go_dark()
            await asyncio.sleep(8 * interval)
            for rank in ranks.values():
                await rank.light_up()
            await asyncio.sleep(4 * interval)
            live = await manager.liveness()
            assert live["ranks"] == [1, 2] and live["dropped_unreachable"] == 0, live

            await ranks[1].go_dark()
            t0 = time.monotonic()
            while (await manager.liveness())["ranks"] != [2]:
                assert time.monotonic() - t0 < 10 * interval, await manager.liveness()
                await asyncio.sleep(0.02)
            dropped_after = time.monotonic() - t0
            print(f"the dark rank dropped {dropped_after:.2f} s after it went dark")
            # (its last answer may have come just before: then two full rounds after it)
            bound = CollectiveManager.LIVENESS_MISSES * interval + timeout
            assert dropped_after <= bound + 0.3, (dropped_after, bound)
            assert (await tracker.stats())["blocks"] == 4  # rank 2's only
            assert (await manager.liveness())["dropped_unreachable"] == 1
            assert await ranks[2].world() == ["", "", addr]  # told rank 1 left

            # the dark rank was alive (a stall, a link that came back): still asked, it is
            # taken back once it answers with this launch's world, and the others get the
            # world with it again (controls: while it stays dark it stays out; an actor that
            # answers at its address with another launch's world stays out too)
            await asyncio.sleep(4 * interval)
            live = await manager.liveness()
            assert live["ranks"] == [2] and live["readmitted"] == 0, live
            await ranks[1].update_world(["", addr, "10.9.9.9:1"])  # another launch's
            await ranks[1].light_up()
            await asyncio.sleep(6 * interval)
            live = await manager.liveness()
            assert live["ranks"] == [2] and live["readmitted"] == 0, live
            await ranks[1].update_world(["", addr, addr])
            t0 = time.monotonic()
            while (await manager.liveness())["ranks"] != [1, 2]:
                assert time.monotonic() - t0 < 10 * interval, await manager.liveness()
                await asyncio.sleep(0.02)
            live = await manager.liveness()
            assert live["readmitted"] == 1 and live["dropped_unreachable"] == 1, live
            assert await ranks[2].world() == ["", addr, addr]
            assert await ranks[1].world() == ["", addr, addr]
            await asyncio.sleep(6 * interval)  # and it is judged again like any rank
            assert (await manager.liveness())["ranks"] == [1, 2]
            await xo.destroy_actor(manager)

    asyncio.run(run())


def test_a_world_update_stuck_in_a_connect_does_not_hold_the_registry():
    """A call to a host that answers nothing can sit in xoscar's connection set-up, which
    does not take its cancellation: ``asyncio.wait_for`` then waits for it to end anyway
    (the control below: the kernel's connect timeout, 20 s in the two-host test).  The
    registry's bound returns on time and leaves the call to end on its own."""
    from xinference.model.llm.vllm.xavier.collective_manager import _within

    async def stuck_in_connect(seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:  # (a connect that finishes before it yields)
            await asyncio.sleep(seconds)
            raise

    async def answers() -> str:
        return "ok"

    async def run():
        t0 = time.monotonic()
        results = await _within(0.2, [stuck_in_connect(1.5), answers()])
        took = time.monotonic() - t0
        assert took < 1.0, took
        assert isinstance(results[0], TimeoutError) and results[1] == "ok"
        # the control: the standard bound waits for the stuck call to take its cancellation
        t0 = time.monotonic()
        late = await asyncio.gather(asyncio.wait_for(stuck_in_connect(1.5), 0.2),
                                    return_exceptions=True)
        assert time.monotonic() - t0 >= 1.4 and isinstance(late[0], BaseException)
        await asyncio.sleep(1.6)  # (the stuck call of the first part ends meanwhile)

    asyncio.run(run())
