"""Page-locked host tiers as CUDA tensors (unified virtual addressing).

A CPU storage tier of a CUDA engine is page-locked (``cudaHostRegister``, mapped and
portable: :func:`~.snapshot_storage.pin_host`).  Through a CUDA view of it the fused copy
kernel reads and writes its slots in place over PCIe, on a CUDA stream, ordered by events
like any GPU copy:

* a load from a CPU tier is launched with the step's other copies (no host gather on the
  completion thread, no extra report delay);
* a demotion from the GPU tier is one gather-scatter into the CPU tier (no device gather,
  host copy and host scatter), and an export into a CPU top tier is one fused gather.

The view comes from vLLM's own op (``get_accelerator_view_from_cpu_tensor``, which asks
CUDA for the device address of the registered memory; vLLM's Model Runner V2 keeps its
own host buffers this way).  Visibility follows CUDA's rule for mapped memory: a kernel
sees what completed before it was launched.  Writers complete (event) before a block is
published, and readers launch after they hold the block's lease, so nothing here adds an
ordering rule to the ones GPU tiers already follow.

A view does not own its memory: whoever holds the views keeps the host tensors (and their
registration) alive for as long as the views are used.  ``XAVIER_UVA=0`` turns views off
(the host paths of :mod:`.storage_writer` and :mod:`.load_completion` take over).
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from ..planning.log_names import package_logger
from .block_copy import layer_tensor

logger = package_logger(__name__)

ENV_SWITCH = "XAVIER_UVA"


def cuda_views(groups: Mapping[int, Sequence[object]], device: Optional[torch.device]
               ) -> Optional[Dict[int, List[torch.Tensor]]]:
    """CUDA views on ``device`` of page-locked host layer tensors per group (tensors or
    ``(name, tensor)``; the views have the same shapes, strides and dtypes); ``None`` when
    ``device`` is not CUDA, a tensor is not page-locked host memory, views are switched
    off, or vLLM's op is missing (logged)."""
    if device is None or device.type != "cuda" or not groups:
        return None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    host = {g: [layer_tensor(item) for item in groups[g]] for g in sorted(groups)}
    flat = [t for ts in host.values() for t in ts]
    if not flat or any(t.device.type != "cpu" for t in flat):
        return None
    try:
        if not all(t.is_pinned() for t in flat):
            return None
        import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops, torch.ops._C)
        from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor as view_of

        with torch.cuda.device(device):
            index = torch.cuda.current_device()  # ``device`` may carry no index
            views = {g: [view_of(t) for t in ts] for g, ts in host.items()}
    except Exception as exc:  # no UVA here: the host paths stay
        logger.info("xavier: no CUDA views of page-locked tiers: %r", exc)
        return None
    for g, ts in views.items():
        for v, t in zip(ts, host[g]):
            if (v.device.type != "cuda" or v.device.index != index or v.shape != t.shape
                    or v.stride() != t.stride() or v.dtype != t.dtype):
                logger.info("xavier: CUDA view of a host tier does not match it (%s on %s, "
                            "expected %s on cuda:%d)", tuple(v.shape), v.device,
                            tuple(t.shape), index)
                return None
    return views
