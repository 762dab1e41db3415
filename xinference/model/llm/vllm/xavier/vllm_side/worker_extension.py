"""``XavierWorkerExtension``: mixed into vLLM's worker (``worker_extension_cls``, set by
``XavierEngine``) so that the model actor reaches the worker's connector with vLLM's
``collective_rpc``: attach, the benchmarks' switches (load mode, victim saves, quiet spell),
the device-memory report, test hooks."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .connector import XavierConnector


def _connector() -> Optional[XavierConnector]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector if isinstance(connector, XavierConnector) else None


class XavierWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``) so that the model actor reaches
    the worker's connector with ``collective_rpc``."""

    def xavier_attach(self) -> bool:
        """Attach the worker's data plane now (``init_xavier``); errors propagate."""
        connector = _connector()
        if connector is None or connector.plane is None:
            return False
        return bool(connector.plane.attach(force=True, raise_errors=True))

    def xavier_set_batched_loads(self, batched: bool) -> bool:
        """Set the worker's load mode (see ``XavierEngine.set_batched_loads``)."""
        connector = _connector()
        if connector is None or connector.plane is None:
            return False
        connector.plane.batched_loads = bool(batched)
        return True

    def xavier_set_victim_saves(self, enabled: bool) -> bool:
        """Copy or drop the step's victim saves (see ``XavierEngine.set_victim_saves``)."""
        connector = _connector()
        if connector is None or connector.plane is None:
            return False
        connector.plane.saves_dropped = not enabled
        return True

    def xavier_set_quiet_ms(self, quiet_ms: int) -> bool:
        """Set the background work's quiet spell (see ``XavierEngine.set_quiet_ms``); False
        before the data plane attached (nothing to set)."""
        connector = _connector()
        if connector is None or connector.plane is None or connector.plane.writer is None:
            return False
        connector.plane.writer.quiet.set(quiet_ms / 1000)
        return True

    def xavier_device_memory(self) -> Dict[str, int]:
        """The worker's device memory as torch's allocator counts it, and vLLM's KV cache
        bytes (``device_memory.device_memory``): what a benchmark compares with a plain
        replica to report the memory Xavier adds."""
        from .device_memory import device_memory

        return device_memory(self)

    def xavier_hook(self, name: str, *args: Any) -> Any:
        """A test hook of the data plane (only when ``XAVIER_TEST_HOOKS`` names a hooks
        class in the engine's environment); refused otherwise."""
        connector = _connector()
        if connector is None or connector.plane is None:
            raise RuntimeError("xavier: no data plane in this worker")
        hooks = connector.plane.hooks
        if hooks is None:
            raise RuntimeError("xavier: test hooks are off (XAVIER_TEST_HOOKS is not set "
                               "in the engine's environment)")
        return getattr(hooks, name)(*args)
