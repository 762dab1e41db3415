"""The fused gather-scatter kernels (mechanism/block_copy_triton.py) on CPU, through
Triton's interpreter (``TRITON_INTERPRET=1``, set in a fresh process before Triton is
imported): the full-grid launch and the narrow one (a fixed number of programs looping
over rows, the room thread's demotions) write exactly the rows asked, bit for bit, for
rows of one and of several chunks, and nothing else.  On CUDA the same kernels run in
tests/test_gpu_transfer_cuda.py and benchmarks/room_interference.py."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import torch
from xinference.model.llm.vllm.xavier.mechanism import block_copy_triton as bct

g = torch.Generator().manual_seed(0)
out = []
for row_words in (100, 1500):  # one chunk of 128 words; two chunks of 1024
    for programs in (None, 1, 3, 5, 7, 64):  # 4 rows x 3 layers: uneven tails too
        src = [torch.randint(0, 1 << 62, (12, row_words), generator=g, dtype=torch.int64)
               for _ in range(3)]
        dst = [torch.randint(0, 1 << 62, (9, row_words), generator=g, dtype=torch.int64)
               for _ in range(3)]
        before = [d.clone() for d in dst]
        s_idx, d_idx = torch.tensor([11, 0, 5, 7]), torch.tensor([2, 8, 0, 4])
        table = lambda layers: torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
        bct.gather_scatter(table(src), table(dst), 3, row_words, row_words, row_words,
                           s_idx, d_idx, programs=programs)
        want = [b.clone() for b in before]
        for w, s in zip(want, src):
            w[d_idx] = s[s_idx]
        out.append(all(torch.equal(d, w) for d, w in zip(dst, want)))
print("RESULT", out)
"""


def test_both_launch_forms_copy_exactly_the_rows_asked():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
    assert run.returncode == 0 and line, run.stderr[-3000:]
    assert line[0] == "RESULT " + str([True] * 12)
