"""One host-to-device copy for all index arrays of a step.

On CUDA, a step's int64 index arrays (source slots, destination blocks, slab
rows of every transfer) are packed into a persistent pinned host buffer and
copied with ONE asynchronous copy on the caller's current stream into a
persistent device buffer; the returned tensors are slices of it.  The caller
must not upload again before the work that reads the previous upload is
finished (the load engine synchronizes its stream at the end of each step).
On CPU the arrays are wrapped without copying.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch


class IndexUploader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: Optional[torch.Tensor] = None
        self._dev: Optional[torch.Tensor] = None

    def upload(self, arrays: Sequence[np.ndarray]) -> List[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        sizes = [int(a.shape[0]) for a in arrays]
        total = sum(sizes)
        if self._host is None or self._host.numel() < total:
            cap = max(total, 2 * (self._host.numel() if self._host is not None else 2048))
            self._host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self._dev = torch.empty(cap, dtype=torch.int64, device=self.device)
        assert self._dev is not None
        if total:
            np.concatenate(arrays, out=self._host.numpy()[:total])
            self._dev[:total].copy_(self._host[:total], non_blocking=True)
        out, offset = [], 0
        for n in sizes:
            out.append(self._dev[offset:offset + n])
            offset += n
        return out

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._host is None else 2 * self._host.numel() * 8

    def close(self) -> None:
        self._host = self._dev = None
