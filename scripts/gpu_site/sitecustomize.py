"""Turns the Xavier import overlay on in every Python process of the GPU machine.

There, Xinference and its dependencies are unpacked with ``pip install --target`` (no site
directory, so the overlay's ``.pth`` line is not run).  Putting this directory first on
``PYTHONPATH`` runs the same ``install()`` at every interpreter start: the xinference-local
supervisor, its worker and model sub pools, and vLLM's engine-core processes.  Any other
``sitecustomize`` later on ``sys.path`` (the image's own) still runs.  Used by
``scripts/gpu-xinference-local.sh``; never installed on a user's machine.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_repo = os.path.dirname(os.path.dirname(_here))
if _repo not in sys.path:
    sys.path.insert(1, _repo)
import _xinference_xavier_overlay  # noqa: E402

_xinference_xavier_overlay.install(
    os.path.join(_repo, "xinference", "model", "llm", "vllm", "xavier"))

for _entry in sys.path:
    _other = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(_other):
        with open(_other) as _f:
            exec(compile(_f.read(), _other, "exec"), {"__name__": "sitecustomize_image"})
        break
