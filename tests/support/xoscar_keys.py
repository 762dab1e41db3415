"""A client of an authenticated xoscar cluster (``XOSCAR_AUTH_KEY``) on one thread of the
test process, whatever the other threads do.

xoscar 0.12.2 reads the key from the process's environment for every frame it signs or
checks (``xoscar.serialization.aio.get_auth_key``); the test process also hosts pools and
clients of unauthenticated worlds, so it never sets the variable.  :func:`signing_with`
makes the frames sent and read on the current thread (an event loop run there, e.g. by
``asyncio.run``) use ``key`` instead; every other thread keeps the environment's answer.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import xoscar.serialization.aio as xoscar_aio

_local = threading.local()
_environment_key = xoscar_aio.get_auth_key


def _thread_key() -> Optional[bytes]:
    key = getattr(_local, "key", None)
    return key if key is not None else _environment_key()


@contextlib.contextmanager
def signing_with(key: str) -> Iterator[None]:
    """Frames of this thread's event loops are signed and checked with ``key``."""
    xoscar_aio.get_auth_key = _thread_key  # (idempotent: the same function each time)
    before = getattr(_local, "key", None)
    _local.key = key.encode("utf-8")
    try:
        yield
    finally:
        _local.key = before
