"""How a worker reaches a peer: the route for each transport and place (pure)."""

import pytest

from xinference.model.llm.vllm.xavier.planning.routes import (
    ROUTE_IPC,
    ROUTE_NIXL,
    ROUTE_SOCKETS,
    host_id,
    peer_route,
)


@pytest.mark.parametrize("transport,same_host,nixl,route", [
    ("xavier", True, True, ROUTE_IPC), ("xavier", True, False, ROUTE_IPC),
    ("xavier", False, True, ROUTE_NIXL), ("xavier", False, False, ROUTE_SOCKETS),
    ("ipc", True, True, ROUTE_IPC),
    ("nixl", True, False, ROUTE_NIXL), ("nixl", False, False, ROUTE_NIXL)])
def test_route_per_transport_and_place(transport, same_host, nixl, route):
    assert peer_route(transport, same_host, nixl) == route


def test_ipc_transport_cannot_reach_another_host():
    with pytest.raises(LookupError, match="another host and the transport is ipc"):
        peer_route("ipc", False, True)


def test_host_id_is_stable_within_a_host():
    assert host_id() == host_id() and "/" in host_id()
