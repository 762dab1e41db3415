#!/usr/bin/env bash
# The main job on its embedded default: two real vLLM replicas (CPU build) of a tiny local model,
# each with Xavier in its own xoscar sub pool, behind a round-robin router, next to two plain
# vLLM replicas (no KV connector) and two with a KV connector that does nothing; the same
# shared-prefix workload on plain vLLM, with sharing off and with Xavier's batched loads, and
# a workload with nothing to share.  Prints the table (tokens/s, TTFT, external hit rate, load
# calls per request) and every replica's counters, and writes
# doc/results/serving_bench-cpu-quick.json.  Extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=/dev/null
. "${VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-ERROR}"
python benchmarks/serving_bench.py --quick "$@"
