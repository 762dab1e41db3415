"""One host-to-device copy for all index arrays of a step.

On CUDA, a step's int64 index arrays (source slots, destination blocks, slab rows of every
transfer) are packed into one page-locked host tensor and copied with ONE asynchronous copy
on the caller's current stream; the returned tensors are slices of the device copy.  Both
buffers come from torch's caching allocators, which do not hand a buffer out again before
the copies queued on it have run: the caller never waits, however far its stream runs
behind.  On CPU the arrays are wrapped without copying.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch


class IndexUploader:
    """Uploads a step's index arrays with one host-to-device copy (see the module docstring)."""
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, arrays: Sequence[np.ndarray]) -> List[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        sizes = [int(a.shape[0]) for a in arrays]
        total = sum(sizes)
        host = torch.empty(max(total, 1), dtype=torch.int64, pin_memory=True)
        if total:
            np.concatenate(arrays, out=host.numpy()[:total])
        dev = host.to(self.device, non_blocking=True)
        out, offset = [], 0
        for n in sizes:
            out.append(dev[offset:offset + n])
            offset += n
        return out

    def close(self) -> None:
        return None
