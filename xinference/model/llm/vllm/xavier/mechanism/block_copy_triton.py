"""Fused gather-scatter of KV blocks over all layers of a group, one Triton launch.

For same-device transfers on CUDA (GPU tier through CUDA IPC, or this rank's
own storage): destination block ``dst_blocks[i]`` of every layer receives
source slot ``src_slots[i]`` of the same layer, read straight from the source
(no slab staging: half the bytes of gather-then-scatter).  Layers are
addressed through int64 pointer tables, so one launch covers every layer.

Requires block views that are 2-D ``int64`` ``[blocks, row_words]`` with rows
contiguous (:func:`.block_copy.block_view` of a contiguous block-first
layer); :func:`supports` says whether a transfer qualifies.  Importing this
module never fails: without a working Triton, :data:`AVAILABLE` is False.

Triton compiles a kernel for each new specialization of its arguments (integers by
divisibility, pointers by 16-byte alignment), on first use, inside the step that needs
it.  The index arrays are slices of one upload at offsets that depend on the step, so
they are not specialized on alignment; the sizes and strides are fixed per pair of
layouts, and :func:`warm` compiles every pair of a worker when it attaches.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..planning.log_names import package_logger
from .block_copy import copy_rows_device, indices_on

logger = package_logger(__name__)

try:  # pragma: no cover - exercised on the GPU machine
    import triton
    import triton.language as tl

    def _jit(fn):  # type: ignore[no-untyped-def]
        try:
            return triton.jit(fn, do_not_specialize_on_alignment=["src_idx", "dst_idx"])
        except TypeError:  # a Triton without the option: one variant per alignment
            return triton.jit(fn)

    @_jit
    def _gather_scatter(src_ptrs, dst_ptrs, src_idx, dst_idx, row_words,
                        src_row_stride, dst_row_stride, BLOCK: tl.constexpr):
        w = tl.program_id(0)
        layer = tl.program_id(1)
        chunk = tl.program_id(2)
        s = tl.load(src_idx + w)
        d = tl.load(dst_idx + w)
        sp = tl.load(src_ptrs + layer).to(tl.pointer_type(tl.int64))
        dp = tl.load(dst_ptrs + layer).to(tl.pointer_type(tl.int64))
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        v = tl.load(sp + s * src_row_stride + offs, mask=mask)
        tl.store(dp + d * dst_row_stride + offs, v, mask=mask)

    def _jit_sizes(fn):  # type: ignore[no-untyped-def]
        try:  # one variant whatever the sizes (they vary per round)
            return triton.jit(fn, do_not_specialize=["n_rows", "n_layers"])
        except TypeError:  # pragma: no cover - a Triton without the option
            return triton.jit(fn)

    @_jit_sizes
    def _gather_scatter_narrow(src_ptrs, dst_ptrs, src_idx, dst_idx, n_rows, n_layers,
                               row_words, src_row_stride, dst_row_stride, BLOCK: tl.constexpr,
                               CHUNKS: tl.constexpr):
        # the same copy from a fixed number of programs, each looping over (row, layer)
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        for i in range(pid, n_rows * n_layers, programs):
            w = i // n_layers
            layer = i % n_layers
            s = tl.load(src_idx + w)
            d = tl.load(dst_idx + w)
            sp = tl.load(src_ptrs + layer).to(tl.pointer_type(tl.int64))
            dp = tl.load(dst_ptrs + layer).to(tl.pointer_type(tl.int64))
            for c in tl.static_range(CHUNKS):
                offs = c * BLOCK + tl.arange(0, BLOCK)
                mask = offs < row_words
                v = tl.load(sp + s * src_row_stride + offs, mask=mask)
                tl.store(dp + d * dst_row_stride + offs, v, mask=mask)

    AVAILABLE = torch.cuda.is_available()
except Exception:  # no triton, or no driver
    AVAILABLE = False


def supports(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor]) -> bool:
    """True when the fused kernel can copy between these block views."""
    if not AVAILABLE or not src_layers or len(src_layers) != len(dst_layers):
        return False
    words = src_layers[0].shape[1] if src_layers[0].dim() == 2 else -1
    s_stride, d_stride = src_layers[0].stride(0), dst_layers[0].stride(0)
    dev = dst_layers[0].device
    for s, d in zip(src_layers, dst_layers):
        if (s.dtype != torch.int64 or d.dtype != torch.int64 or s.dim() != 2 or d.dim() != 2
                or s.shape[1] != words or d.shape[1] != words or s.stride(1) != 1
                or d.stride(1) != 1 or s.stride(0) != s_stride or d.stride(0) != d_stride
                or s.device != dev or d.device != dev or dev.type != "cuda"):
            return False
    return True


def pointer_table(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 device tensor of the layers' base addresses (build once per mapping), copied
    on the current stream from page-locked memory: the host never waits for the stream
    (a pageable copy would wait for everything queued before it)."""
    host = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    return host.pin_memory().to(layers[0].device, non_blocking=True)


def _launch_shape(row_words: int) -> Tuple[int, int]:
    """(BLOCK, chunks per row) of one launch."""
    block = min(1024, triton.next_power_of_2(row_words))
    return block, triton.cdiv(row_words, block)


def warm(view_sets: Sequence[Sequence[torch.Tensor]], num_warps: int = 4) -> int:
    """Compile the kernel (both launch forms) for every ordered pair of ``view_sets`` it
    supports (a worker's engine layers and each storage tier's), so that no step compiles
    it; returns the variants compiled.  Peers' storages have the layout of this rank's (the
    KV schema check), so their loads use these variants too.  A failure is logged: the kernel
    then compiles on first use, as without this."""
    seen = set()
    for src in view_sets:
        for dst in view_sets:
            if src is dst or not supports(src, dst):
                continue
            row_words = int(dst[0].shape[1])
            key = (row_words, src[0].stride(0), dst[0].stride(0))
            if key in seen:
                continue
            seen.add(key)
            dev = dst[0].device
            table = torch.zeros(len(dst), dtype=torch.int64, device=dev)
            idx = torch.zeros(1, dtype=torch.int64, device=dev)
            block, chunks = _launch_shape(row_words)
            try:
                _gather_scatter.warmup(table, table, idx, idx, row_words, key[1], key[2],
                                       BLOCK=block, num_warps=num_warps,
                                       grid=(1, len(dst), chunks))
            except Exception as exc:  # pragma: no cover - depends on the Triton version
                logger.info("xavier: warming the copy kernel failed (it compiles on first "
                            "use): %r", exc)
                return 0
            try:  # (the room thread's demotions: compiled there on first use otherwise)
                _gather_scatter_narrow.warmup(table, table, idx, idx, 2, len(dst), row_words,
                                              key[1], key[2], BLOCK=block, CHUNKS=chunks,
                                              num_warps=num_warps, grid=(1,))
            except Exception as exc:  # pragma: no cover - depends on the Triton version
                logger.info("xavier: warming the narrow copy kernel failed: %r", exc)
    return len(seen)


def gather_scatter(src_table: torch.Tensor, dst_table: torch.Tensor, n_layers: int,
                   row_words: int, src_row_stride: int, dst_row_stride: int,
                   src_idx: torch.Tensor, dst_idx: torch.Tensor, num_warps: int = 4,
                   programs: Optional[int] = None) -> None:
    """Launch on the current stream: for every layer and i, dst[dst_idx[i]] = src[src_idx[i]].

    ``programs``: at most that many thread blocks, each looping over rows, for a background
    copy into page-locked host memory: beside a full-grid 512-block one a decode step took
    3.8x its time on an H100 (the writes in flight stall its memory traffic: 16 blocks
    still cost 3.2x), beside 4 blocks 1.2x at 85 % of the bandwidth
    (``benchmarks/room_interference.py``); None: one per (row, layer, chunk)."""
    n = int(dst_idx.shape[0])
    if n == 0:
        return
    block, chunks = _launch_shape(row_words)
    if programs is not None:
        _gather_scatter_narrow[(max(1, min(programs, n * n_layers)),)](
            src_table, dst_table, src_idx, dst_idx, n, n_layers, row_words, src_row_stride,
            dst_row_stride, BLOCK=block, CHUNKS=chunks, num_warps=num_warps)
        return
    grid = (n, n_layers, chunks)
    _gather_scatter[grid](src_table, dst_table, src_idx, dst_idx, row_words,
                          src_row_stride, dst_row_stride, BLOCK=block, num_warps=num_warps)


class FusedCopier:
    """Copies between block views of one CUDA device for callers on several streams (the
    storage writer's export and room threads): row ``dst_slots[i]`` of every layer of
    ``dst`` receives row ``src_slots[i]`` of ``src``, on the current stream (from at most
    ``programs`` thread blocks when given: :func:`gather_scatter`).  The fused
    kernel where it applies, with pointer tables built once per key on whichever stream
    first needed them, each use ordered after the table's upload; the torch gather
    otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: Dict[Tuple[object, int], Tuple[torch.Tensor, torch.cuda.Event]] = {}

    def copy(self, src_key: Tuple[object, int], src: List[torch.Tensor],
             dst_key: Tuple[object, int], dst: List[torch.Tensor],
             src_slots: Sequence[int], dst_slots: Sequence[int],
             programs: Optional[int] = None) -> None:
        src_idx, dst_idx = indices_on(src_slots, self.device), indices_on(dst_slots, self.device)
        if not supports(src, dst):
            copy_rows_device(src, dst, src_idx, dst_idx)
            return
        stream = torch.cuda.current_stream(self.device)
        tables = []
        for key, views in ((src_key, src), (dst_key, dst)):
            entry = self._tables.get(key)
            if entry is None:
                table, uploaded = pointer_table(views), torch.cuda.Event()
                uploaded.record(stream)
                entry = self._tables[key] = (table, uploaded)
            stream.wait_event(entry[1])
            tables.append(entry[0])
        gather_scatter(tables[0], tables[1], len(dst), int(dst[0].shape[1]), src[0].stride(0),
                       dst[0].stride(0), src_idx, dst_idx, programs=programs)

    def clear(self) -> None:
        self._tables.clear()
