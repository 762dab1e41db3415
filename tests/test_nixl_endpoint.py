"""NIXL through pools that have no NIXL address (as Xinference makes every replica's sub
pool): the loader's process gets a ``nixl://`` endpoint of its own and peers' ``copy_to``
writes into it through NIXL.

First the mechanism alone (two plain sub pools, a real NIXL agent on each side, UCX on
loopback), then the whole path: two real vLLM replicas launched with
``vllm_transfer_backend_type: nixl`` on plain pools, a cross-replica hit whose bytes came
through NIXL, tokens equal to the no-sharing run.
"""

from typing import Any, List

import numpy as np
import pytest
import xoscar as xo

from xinference.model.llm.vllm.xavier.mechanism.nixl_endpoint import (
    endpoint_host,
    open_nixl_endpoint,
)

from .support.pools import actor_pool, nixl_available, sub_pool_addresses
from .support.scenarios import assert_loaded_bytes_exact, cross_replica_hit, leases
from .support.worlds import World

PREFIX = 512  # tokens: 32 blocks of 16
BLOCK = 16

needs_nixl = pytest.mark.skipif(not nixl_available(),
                                reason="NIXL not installed (scripts/setup.sh installs it)")


def test_endpoint_host_is_the_host_of_the_rank_address():
    assert endpoint_host("10.0.0.5:34567") == "10.0.0.5"
    assert endpoint_host("nixl://node-3:1") == "node-3"
    with pytest.raises(ValueError, match="rank_address: no host in ':80'"):
        endpoint_host(":80")


PAYLOAD = np.arange(1024, dtype=np.uint32).view(np.uint8)  # 4096 bytes, none alike in 4


class Receiver(xo.StatelessActor):
    """A loader's side: staging rows registered under the endpoint's address."""

    async def open(self) -> str:
        self._endpoint = await open_nixl_endpoint(self.address)
        return self._endpoint.address

    async def receive(self, sender: Any, nbytes: int, nixl: bool = True) -> List[int]:
        rows = np.zeros(nbytes, dtype=np.uint8)
        address = self._endpoint.address if nixl else self.address
        await sender.send([xo.buffer_ref(address, rows)])
        return rows.tolist()

    async def close(self) -> None:
        await self._endpoint.close()
        await self._endpoint.close()  # idempotent


class Sender(xo.StatelessActor):
    """A source's side: counts the copies that went through xoscar's NIXL channel."""

    def __init__(self) -> None:
        super().__init__()
        self.nixl_copies = 0

    async def __post_create__(self) -> None:
        from xoscar.backends.communication import nixl

        original = nixl.NixlChannel.copy_buffers

        async def counted(channel: Any, *args: Any, **kwargs: Any) -> Any:
            self.nixl_copies += 1
            return await original(channel, *args, **kwargs)

        nixl.NixlChannel.copy_buffers = counted  # this sub pool's process only

    async def send(self, refs: List[Any]) -> None:
        await xo.copy_to([PAYLOAD.copy()], refs)

    def copies(self) -> int:
        return self.nixl_copies


@needs_nixl
def test_plain_pool_receives_copy_to_through_its_nixl_endpoint():
    import asyncio

    async def run() -> None:
        async with actor_pool(n_process=2) as pool:  # plain addresses, as Xinference's
            recv_addr, send_addr = sub_pool_addresses(pool)
            assert "://" not in recv_addr
            receiver = await xo.create_actor(Receiver, address=recv_addr, uid="receiver")
            sender = await xo.create_actor(Sender, address=send_addr, uid="sender")
            endpoint = await receiver.open()
            assert endpoint.startswith(f"nixl://{endpoint_host(recv_addr)}:")
            assert await receiver.receive(sender, 4096) == PAYLOAD.tolist()  # bit-exact
            assert await sender.copies() == 1  # through NIXL, not the pool's sockets
            # control: the same copy into the pool's own (plain) address takes no NIXL
            assert await receiver.receive(sender, 4096, nixl=False) == PAYLOAD.tolist()
            assert await sender.copies() == 1
            await receiver.close()

    asyncio.run(run())


@needs_nixl
@pytest.mark.slow
def test_replicas_launched_with_nixl_transport_load_through_nixl(nixl_pair: World):
    lt, r = nixl_pair.pair
    a, b = r.replicas
    hit = cross_replica_hit(lt, r, seed=5, prefix=PREFIX)
    c = hit.counters
    assert c["blocks_written"] == PREFIX // BLOCK and c["load_failures"] == 0
    # one host, but the nixl transport maps the peer through copy_to into B's NIXL endpoint
    after = lt.run(b.counters())
    assert after.get("peers_mapped_nixl", 0) == 1
    assert after.get("peers_mapped_ipc", 0) == 0 and after.get("peers_mapped_sockets", 0) == 0
    assert_loaded_bytes_exact(lt, r, PREFIX // BLOCK)
    assert leases(lt, r) == 0
