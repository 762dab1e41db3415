"""Synchronous callers reaching real xoscar actors through the bridge's loop thread."""

import asyncio
import time

import pytest
import xoscar as xo

from xinference.model.llm.vllm.xavier.vllm_side.actor_bridge import ActorBridge, LazyActor

from .support.pools import actor_served


class Echo(xo.StatelessActor):
    async def echo(self, x, delay=0.0):
        await asyncio.sleep(delay)
        return x


@pytest.fixture(scope="module")
def pool_address():
    with actor_served(Echo, "echo") as address:
        yield address


def test_lazy_actor_found_later_and_called_synchronously(pool_address):
    bridge = ActorBridge.shared()
    missing = LazyActor(bridge, pool_address, "not-yet", retry_seconds=0.2)
    assert missing.get() is None
    assert missing.get() is None  # rate-limited: no second lookup within retry_seconds
    echo = LazyActor(bridge, pool_address, "echo")
    ref = echo.get()
    assert ref is not None and bridge.call(lambda: ref.echo(7)) == 7
    with pytest.raises(TimeoutError, match="did not finish within 0.2 s"):
        bridge.call(lambda: ref.echo(1, delay=2.0), timeout=0.2)
    done = []
    bridge.submit(lambda: ref.echo(3), "echo")
    bridge.submit(lambda: _record(ref, done), "record")
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done == [5]


async def _record(ref, done):
    done.append(await ref.echo(5))


def test_an_unchecked_ref_reaches_an_actor_again_once_it_is_back(pool_address):
    """The block directory's way: no lookup to wait for; a call fails while the actor is
    gone and succeeds at once when it is back at its address."""
    bridge = ActorBridge.shared()
    later = LazyActor(bridge, pool_address, "comes-later", checked=False)
    ref = later.get()
    assert ref is not None
    from xoscar.errors import ActorNotExist

    with pytest.raises(ActorNotExist):
        bridge.call(lambda: ref.echo(1), timeout=10)
    later.forget()
    bridge.call(lambda: xo.create_actor(Echo, address=pool_address, uid="comes-later"),
                timeout=30)
    assert bridge.call(lambda: later.get().echo(2), timeout=10) == 2
