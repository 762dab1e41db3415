#!/usr/bin/env bash
# Issue #6 on the GPU machine: real xinference-local (3.5.0), two vLLM 0.26.0 replicas,
# "enable_xavier": true over REST, shared-prefix requests over the OpenAI-compatible API
# (tests/test_xinference_local.py with XAVIER_TEST_DEVICE=cuda).  Run by the device tool:
#
#   carry: .vbundle/vllm-0.26.0-sm90-cp312-site.tar.xz .vbundle/use-vllm-bundle.sh .whl .xinfwhl
#   command: bash scripts/gpu-xinference-local.sh          (XAVIER_TEST_GPUS=0,1 on two GPUs)
#
# .whl: xoscar + tblib (doc/gpu.md); .xinfwhl: scripts/make-xinference-gpu-wheels.sh.  The
# overlay is switched on in every process by scripts/gpu_site/sitecustomize.py.  Logs (the
# test's and xinference-local's own) go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/xavier-gpu-out}
mkdir -p "$out"
source .vbundle/use-vllm-bundle.sh .vbundle || exit 1
# the bundle carries no .pyc: with PYTHONDONTWRITEBYTECODE set, every process (each engine
# core, each replica's pool) would compile vLLM from source again (on the 2-core CPU
# machine: 30 vs 12 s an import of vLLM's engine); let the first import write them
echo "PYTHONDONTWRITEBYTECODE was ${PYTHONDONTWRITEBYTECODE:-unset} (now unset)" >&2
unset PYTHONDONTWRITEBYTECODE
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl .xinfwhl/*.whl || exit 1
export PYTHONPATH=$PWD/scripts/gpu_site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
export XAVIER_TEST_DEVICE=cuda XAVIER_TEST_GPUS=${XAVIER_TEST_GPUS:-0,0} XAVIER_TEST_LOG_DIR=$out
python3 -c "import xinference, vllm, xoscar; from xinference.model.llm.vllm import xavier; \
print('xinference', xinference.__version__, 'vllm', vllm.__version__, 'xavier from', xavier.__file__)" \
  2>&1 | tee "$out/versions.txt"
timeout ${XAVIER_GPU_TEST_TIMEOUT:-540} python3 -m pytest -v -s -p no:cacheprovider \
  tests/test_xinference_local.py 2>&1 | tee "$out/xinference-local-gpu.log"
rc=${PIPESTATUS[0]}
# teardown order: the transfer actors let go of CUDA IPC mappings before their owners exit
for needle in "engine released" "Producer process has been terminated" "force killing"; do
  printf '%-40s %s\n' "$needle" "$(grep -c "$needle" "$out/xinference-local.log" 2>/dev/null)"
done | tee "$out/teardown.txt"
exit "$rc"
