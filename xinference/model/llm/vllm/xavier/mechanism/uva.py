"""Page-locked host memory as CUDA tensors (unified virtual addressing).

A CPU storage tier of a CUDA engine is page-locked (``cudaHostRegister``); with a CUDA view
of it, the copy kernels write its slots in place over PCIe: a demotion from the GPU tier is
one gather-scatter into the CPU tier (no device gather, host copy and host scatter), and an
export into a CPU top tier is one fused gather.  Only the storage writer uses views, and
only to WRITE host tiers: the writes are visible to every reader once the copy's event
completed (CUDA's rule for mapped memory), which is before the blocks are published.
Loads keep reading host tiers with copies (no kernel reads host memory through a view, so
no GPU cache can hold a slot's old bytes).  The view comes from vLLM's own op
(``get_cuda_view_from_cpu_tensor``: it asks CUDA for the device address of the registered
memory and fails cleanly when there is none).

A view does not own its memory: the caller keeps the host tensors (and their
registration) alive for as long as the view is used.  ``XAVIER_UVA=0`` turns views off.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "XAVIER_UVA"


def uva_views(tensors: Sequence[torch.Tensor], device: torch.device
              ) -> Optional[List[torch.Tensor]]:
    """CUDA views on ``device`` of page-locked host ``tensors`` (same shapes, strides and
    dtypes); ``None`` when ``device`` is not CUDA, any tensor is not page-locked host
    memory, views are switched off, or the op is missing."""
    if device.type != "cuda" or not tensors or os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if any(t.device.type != "cpu" for t in tensors):
        return None
    try:
        if not all(t.is_pinned() for t in tensors):
            return None
        import vllm._C  # noqa: F401  (registers torch.ops._C)

        view_of = torch.ops._C.get_cuda_view_from_cpu_tensor
        with torch.cuda.device(device):
            views = [view_of(t) for t in tensors]
    except Exception as exc:  # no UVA here: the host paths stay
        logger.info("xavier: no CUDA views of page-locked tiers: %r", exc)
        return None
    if any(v.device != device for v in views):
        return None
    return views
