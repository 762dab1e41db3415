"""How a worker reaches a peer: the route for each transport and place (pure), and what
counts as one host."""

import os
import subprocess
import sys

import pytest

from xinference.model.llm.vllm.xavier.planning import routes
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
    ("nixl", True, False, ROUTE_NIXL), ("nixl", False, False, ROUTE_NIXL),
    ("sockets", True, True, ROUTE_IPC), ("sockets", False, True, ROUTE_SOCKETS)])
def test_route_per_transport_and_place(transport, same_host, nixl, route):
    assert peer_route(transport, same_host, nixl) == route


def test_ipc_transport_cannot_reach_another_host():
    with pytest.raises(LookupError, match="another host and the transport is ipc"):
        peer_route("ipc", False, True)


def test_host_id_is_stable_within_a_host():
    assert host_id() == host_id() and "/" in host_id()


#: routes.py is stdlib only: run from its file, without importing Xinference (and vLLM)
HOST_ID = (f"import runpy; print(runpy.run_path({routes.__file__!r})['host_id']())")


@pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("XAVIER_TEST_REQUIRE_NETNS") != "1",
                    reason="a network namespace needs root")
def test_another_network_namespace_is_another_host():
    """A process in a network namespace of its own (a simulated host, a container) cannot
    count as this host: peers there are read over the network, never mapped; a process in
    this namespace (negative control) counts as this host."""
    same = subprocess.run([sys.executable, "-c", HOST_ID], capture_output=True, text=True,
                          check=True).stdout.strip()
    other = subprocess.run(["unshare", "--net", sys.executable, "-c", HOST_ID],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert same == host_id()
    assert other != host_id() and other.split("/")[:2] == host_id().split("/")[:2]
