"""Die with the parent: vLLM's engine-core and worker processes outlive a replica process
that is killed (SIGKILL, OOM killer): seen in the reliability suite, an orphaned engine
core and worker kept running (and on a GPU would keep their memory).  The connector is
built in both of them, so it starts this watch there.

:func:`watch_parent` starts (once per process) a daemon thread that notices when the
process is re-parented (its parent died) and then terminates the process: SIGTERM first
(vLLM's own shutdown, which also stops its children, each watching in turn), SIGKILL if it
is still alive ``grace_s`` later.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from ..planning.log_names import package_logger

logger = package_logger(__name__)

_started_for: Optional[int] = None
_lock = threading.Lock()


def watch_parent(interval_s: float = 0.5, grace_s: float = 10.0) -> bool:
    """Start the watch in this process; returns False if it already runs here."""
    global _started_for
    with _lock:
        if _started_for == os.getpid():
            return False
        _started_for = os.getpid()
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logger.error("xavier: parent process %d is gone: terminating process %d", parent,
                     os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, name="xavier-parent-watch", daemon=True).start()
    return True
