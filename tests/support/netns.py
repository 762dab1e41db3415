"""Simulated hosts on one machine: Linux network namespaces joined by a veth pair.

Each host has its own loopback, its own ports and one address on a private /24 that only
these namespaces see; nothing routes elsewhere.  The file system and ``/dev/shm`` stay
shared, so tests must check which channel moved the bytes.  Needs root
(../shared/notes/real-parts-recipes.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class SimulatedHosts:
    """Two namespaces ``<prefix>a`` / ``<prefix>b`` with addresses ``10.77.<n>.1`` / ``.2``."""

    def __init__(self, prefix: str, subnet: int = 77) -> None:
        self.names = [f"{prefix}a", f"{prefix}b"]
        self.addresses = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
        self._veth = [f"v{prefix[-8:]}a", f"v{prefix[-8:]}b"]
        self._procs: List[subprocess.Popen] = []

    def create(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
        for name, veth, address in zip(self.names, self._veth, self.addresses):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def popen(self, host: int, argv: Sequence[str], env: Dict[str, str], log_path: str
              ) -> subprocess.Popen:
        """Start ``argv`` in host ``host``'s namespace, in a process group of its own."""
        log = open(log_path, "a")
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._procs.append(proc)
        return proc

    def go_dark(self, host: int) -> None:
        """Host ``host`` stops answering the others: every packet it sends them is dropped
        (a blackhole route inside its namespace), so their connections neither get a reply
        nor a reset -- a host that lost power or whose link was cut, as seen from the
        others.  (What ``iptables -j DROP`` would do; this kernel has no iptables.)"""
        for other, address in enumerate(self.addresses):
            if other != host:
                _ip("-n", self.names[host], "route", "add", "blackhole", f"{address}/32")

    def light_up(self, host: int) -> None:
        """Undo :meth:`go_dark`."""
        for other, address in enumerate(self.addresses):
            if other != host:
                _ip("-n", self.names[host], "route", "del", "blackhole", f"{address}/32")

    def pids(self, host: int) -> List[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                             text=True, timeout=30).stdout
        return [int(p) for p in out.split()]

    def run_in(self, host: int, fn: Callable[[], Any], timeout: float = 600) -> Any:
        """``fn()`` on a thread that entered host ``host``'s network namespace (sockets it
        opens live there); its result or its exception."""
        box: Dict[str, Any] = {}

        def body() -> None:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = os.open(f"/var/run/netns/{self.names[host]}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"run_in({self.names[host]}) took more than {timeout} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def destroy(self) -> None:
        """Kill everything left in the namespaces, then delete them (the veth goes too)."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for host in range(len(self.names)):
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(self.pids(h) for h in range(len(self.names))) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    def exists(self) -> List[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [n for n in self.names if any(line.split()[0] == n
                                             for line in out.splitlines() if line.strip())]


@contextlib.contextmanager
def simulated_hosts(prefix: Optional[str] = None) -> Iterator[SimulatedHosts]:
    hosts = SimulatedHosts(prefix or f"xv{os.getpid()}")
    try:
        hosts.create()
        yield hosts
    finally:
        hosts.destroy()
