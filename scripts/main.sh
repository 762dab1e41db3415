#!/usr/bin/env bash
# The main job on its embedded default.  Until the vLLM connector lands (issue #5) this is
# the batched-load benchmark: per-request vs batched loads of the same KV blocks, in process
# and through a real xoscar actor in a separate process.  Extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=/dev/null
. "${VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1
python benchmarks/transfer_bench.py --quick "$@"
