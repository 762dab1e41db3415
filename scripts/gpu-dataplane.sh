#!/usr/bin/env bash
# Issues #16/#17 on the GPU machine (nvidia-h200), one device call: the worker-side data plane
# and vLLM's defaults, checked and measured.  Run by the device tool:
#
#   carry: .vbundle .whl            (or .vbmla .whl for `mla`: see below)
#   command: bash scripts/gpu-dataplane.sh [units|tests|e2e|hybrid|fp8|mla|models|bench|chat|crossover|peers|tp|tpbench|all]...
#
# units: the load engine, storage writer and storage on CUDA (as in tests, alone);
# tests: the load engine, storage writer and storage on CUDA (XAVIER_TEST_DEVICE=cuda, the
#        CUDA-only tests included), then the connector end to end with vLLM's defaults (CUDA
#        graphs, async scheduling, the model runner vLLM picks), then transfer_bench,
#        copy_kernel_profile and export_bench;
# e2e:   the connector end to end alone (the first half of `tests`; XAVIER_E2E_FILES picks
#        the test files: each shared world takes ~330 s to start with CUDA graphs);
# hybrid: the tiny Gemma-3-shaped (sliding-window + full attention) model end to end with
#        vLLM's hybrid KV-cache manager (issue #18);
# fp8:   the connector end to end (the tests that a KV dtype can change) on an fp8 KV cache
#        (kv_cache_dtype="fp8", issue #18);
# mla:   the tiny DeepSeek-V2-shaped (MLA) model end to end (issue #18).  vLLM's only MLA
#        prefill on Hopper is FlashAttention-3, which the bundle leaves out: the bundle
#        folder (VB_DIR, default .vbundle) must also hold _vllm_fa3_C.abi3.so.xz
#        (10.9 MB; made by `bash scripts/make-mla-bundle.sh`, which also drops the bundle's
#        tiny model so that everything fits one call's 64 MiB);
# models: hybrid, fp8 and mla;
# bench: serving_bench, Qwen2.5-0.5B shape, 8K prefixes, C1/C8/C32, plain / local-hit /
#        none / per_request / batched, the unique-prompt rows, tiers full (--steady-state)
#        with Xavier's default budgets.  XAVIER_BENCH_MODES picks the modes,
#        XAVIER_BENCH_UNIQUE= drops the unique-prompt rows, XAVIER_BENCH_ARGS adds arguments
#        (e.g. --switch-interval-us 500), BENCH_TIMEOUT its limit (s, default 570);
#        XAVIER_STEP_TRACE=$OUT/trace traces every connector call (a folder per Xavier pair);
#        each pair's report (each replica's last 10 hits) goes to $OUT/step_trace-PAIR.{txt,json}.
# tp:    issue #22 on nvidia-h200-x2: two TP=2 replicas, each on both GPUs, end to end
#        (tests/test_tp_e2e.py); tpbench: serving_bench --tp 2 (plain, none, batched; the
#        Qwen2.5-0.5B shape, 2 KV heads: one per worker).  Neither is part of `all`; one
#        call each (a call lasts at most 600 s).
# chat:  issue #34: serving_bench's chat rows (32 users, 4 turns of 768 tokens after a
#        1024-token system prompt; XAVIER_CHAT_USERS, XAVIER_CHAT_SHAPE) (not in `all`).
# crossover: issue #34: C1 follow-up TTFT by prefix length (256-2048 tokens), sharing off
#        and batched, every hit loaded (XAVIER_LOAD_POLICY=always) then the cost model's choice
#        (cost); XAVIER_CROSSOVER_PREFIXES, XAVIER_CROSSOVER_POLICIES (not in `all`).
# peers: issue #35: serving_bench with vLLM's own tiered offloading (vllm-offload-fs) beside
#        plain, local-hit and batched, 8K prefixes, C1/C8/C32, steady state (not in `all`).
# room:  what a room-thread demotion (UVA kernel vs copy engine) costs a decode step beside it
#        (benchmarks/room_interference.py; not in `all`).
# Logs and JSON go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/xavier-gpu-out}
mkdir -p "$out"
what=" ${*:-tests} "
bundle=${VB_DIR:-.vbundle}
source "$bundle/use-vllm-bundle.sh" "$bundle" || exit 1
# the bundle carries no .pyc: with PYTHONDONTWRITEBYTECODE set, every process (each engine
# core, each replica's pool) would compile vLLM from source again (on the 2-core CPU
# machine: 30 vs 12 s an import of vLLM's engine); let the first import write them
echo "PYTHONDONTWRITEBYTECODE was ${PYTHONDONTWRITEBYTECODE:-unset} (now unset)" >&2
unset PYTHONDONTWRITEBYTECODE
fa3=/tmp/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
if [ -f "$bundle/_vllm_fa3_C.abi3.so.xz" ] && [ ! -f "$fa3" ]; then
  xz -dc "$bundle/_vllm_fa3_C.abi3.so.xz" > "$fa3.part" && mv "$fa3.part" "$fa3" || exit 1
fi
has() { case "$what" in *" $1 "*|*" all "*) return 0 ;; esac; return 1; }
only() { case "$what" in *" $1 "*) return 0 ;; esac; return 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/scripts/gpu_site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 XAVIER_TINY_MODEL_DIR=/tmp/tiny-qwen2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
# PYSPY_GIL=1: the bench runs under py-spy (its wheel carried in .prof/), sampling which
# thread of every process holds the GIL (summary: scripts/pyspy_gil.py)
prof=()
if [ -n "${PYSPY_GIL:-}" ] && ls .prof/py_spy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .prof/py_spy-*.whl \
    && prof=(/tmp/pyspy/bin/py-spy record --subprocesses --nonblocking --threads --gil -f raw \
             -r "${PYSPY_RATE:-100}" -o "$out/pyspy-gil.txt" --)
fi
rc=0
if has tests || has units; then
  XAVIER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu_transfer.py tests/test_gpu_transfer_cuda.py tests/test_storage_writer.py \
    tests/test_snapshot_storage.py tests/test_plan.py tests/test_load_batch.py \
    tests/test_lookups.py tests/test_block_directory.py tests/test_read_checks.py \
    tests/test_slot_generations.py tests/test_in_place.py tests/test_pool_watch.py \
    tests/test_in_place_caches.py 2>&1 | tee "$out/pytest-cuda.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if has tests || only e2e; then
  XAVIER_TEST_DEVICE=cuda timeout "${XAVIER_TEST_PART_TIMEOUT:-330}" python3 -m pytest -v -s \
    -p no:cacheprovider ${XAVIER_E2E_FILES:-tests/test_connector_e2e.py tests/test_in_place_e2e.py} 2>&1 \
    | tee "$out/e2e-cuda.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if has tests; then
  timeout 60 python3 benchmarks/copy_kernel_profile.py 2>&1 | tee "$out/copy_kernel_profile.log"
  timeout 90 python3 benchmarks/transfer_bench.py --device cuda --reps 5 \
    --out "$out/transfer_bench-cuda.json" 2>&1 | tee "$out/transfer_bench-cuda.log"
  timeout 90 python3 benchmarks/export_bench.py --device cuda --gpu-gib 1 --cpu-gib 1 \
    --steps 24 --out "$out/export_bench-cuda.json" 2>&1 | tee "$out/export_bench-cuda.log"
fi
if has hybrid || has models; then
  # issue #18: the hybrid (sliding-window + full attention) model with vLLM's hybrid manager
  XAVIER_TINY_HYBRID_MODEL_DIR=/tmp/tiny-gemma3 XAVIER_TEST_DEVICE=cuda \
    timeout "${XAVIER_TEST_PART_TIMEOUT:-330}" python3 -m pytest -v -s -p no:cacheprovider \
    tests/test_hybrid_e2e.py 2>&1 | tee "$out/e2e-hybrid-cuda.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if has mla || has models; then
  # issue #18: multi-head latent attention (one latent cache per layer)
  XAVIER_TINY_MLA_MODEL_DIR=/tmp/tiny-deepseek-v2 XAVIER_TEST_DEVICE=cuda \
    timeout "${XAVIER_TEST_PART_TIMEOUT:-330}" python3 -m pytest -v -s -p no:cacheprovider \
    tests/test_mla_e2e.py 2>&1 | tee "$out/e2e-mla-cuda.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if has fp8 || has models; then
  # issue #18: an fp8 KV cache; the tests whose outcome the KV dtype can change
  XAVIER_TEST_KV_CACHE_DTYPE=fp8 XAVIER_TEST_DEVICE=cuda \
    timeout "${XAVIER_TEST_PART_TIMEOUT:-330}" python3 -m pytest -v -s -p no:cacheprovider \
    tests/test_connector_e2e.py -k "dtype or cross_replica_hit or negative_control or \
    failed_block or concurrent" 2>&1 | tee "$out/e2e-fp8-cuda.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if only room; then
  # session 36's open question: what a demotion by the room thread (UVA kernel vs copy engine)
  # costs a decode step running beside it
  timeout 150 python3 benchmarks/room_interference.py --blocks 128,512 --reps 30 --programs 4,8,16,32 2>&1 \
    | tee "$out/room_interference.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if has bench; then
  timeout "${BENCH_TIMEOUT:-570}" "${prof[@]}" python3 benchmarks/serving_bench.py --device cuda --shape qwen2.5-0.5b \
    --prefix-tokens 8192 --concurrency 1,8,32 --groups 32 --max-tokens 32 --steady-state \
    --modes "${XAVIER_BENCH_MODES:-plain,local-hit,none,per_request,batched}" \
    ${XAVIER_BENCH_UNIQUE---unique} ${XAVIER_BENCH_ARGS:-} --out "$out/serving_bench-cuda-qwen2.5-0.5b-steady.json" 2>&1 \
    | grep --line-buffered -v "it/s]" > "$out/serving_bench.log"
  rc=$((rc | PIPESTATUS[0]))
  grep -E "^\[serving|^(plain|local-hit|none|per_request|batched)" "$out/serving_bench.log"
  for trace in "${XAVIER_STEP_TRACE:-/nonexistent}"/*/; do  # one folder per Xavier pair
    ls "$trace"trace-*.jsonl >/dev/null 2>&1 || continue
    pair=$(basename "$trace")
    python3 scripts/step_trace_report.py "$trace" --last 10 \
      --json "$out/step_trace-$pair.json" | tee "$out/step_trace-$pair.txt"
    xz -9 "$trace"trace-*.jsonl
  done
  if [ -f "$out/pyspy-gil.txt" ]; then
    python3 scripts/pyspy_gil.py "$out/pyspy-gil.txt" > "$out/pyspy-gil-summary.txt" 2>&1
    xz -9 "$out/pyspy-gil.txt"
  fi
fi
if only chat; then
  # issue #34: the chat workload (a shared system prompt, growing per-user histories, closed
  # loop per user, round robin) at 32 users, beside a minimal shared-prefix section
  timeout 570 python3 benchmarks/serving_bench.py --device cuda --shape qwen2.5-0.5b \
    --prefix-tokens 8192 --concurrency 1 --groups 4 --max-tokens 32 \
    --chat "${XAVIER_CHAT_USERS:-32}" --chat-shape "${XAVIER_CHAT_SHAPE:-4,1024,768}" \
    --modes "${XAVIER_BENCH_MODES:-plain,local-hit,none,batched}" ${XAVIER_BENCH_ARGS:-} \
    --out "$out/serving_bench-cuda-qwen2.5-0.5b-chat.json" 2>&1 \
    | grep --line-buffered -v "it/s]" > "$out/serving_bench-chat.log"
  rc=$((rc | PIPESTATUS[0]))
  grep -E "^\[serving|^(plain|local-hit|none|batched)|tokens equal" "$out/serving_bench-chat.log"
fi
if only crossover; then
  # issue #34: where a C1 hit starts to pay, by prefix length: every hit loaded
  # (XAVIER_LOAD_POLICY=always, the measured crossover) and the cost model's choice (cost)
  policies=${XAVIER_CROSSOVER_POLICIES:-always,cost}
  for policy in ${policies//,/ }; do
    XAVIER_LOAD_POLICY=$policy timeout 280 python3 benchmarks/serving_bench.py --device cuda \
      --shape qwen2.5-0.5b --prefix-tokens "${XAVIER_CROSSOVER_PREFIXES:-256,512,1024,2048}" \
      --concurrency 1 --groups 4 --max-tokens 16 --modes "${XAVIER_BENCH_MODES:-none,batched}" \
      --out "$out/serving_bench-cuda-crossover-$policy.json" 2>&1 | grep --line-buffered -v "it/s]" \
      > "$out/serving_bench-crossover-$policy.log"
    rc=$((rc | PIPESTATUS[0]))
    grep -E "^(none|batched)" "$out/serving_bench-crossover-$policy.log" | head -8
  done
fi
if only peers; then
  # issue #35: Xavier beside vLLM's own tiered offloading (OffloadingConnector: CPU tier +
  # a shared fs tier) in one run; vLLM 0.26.0 opens fs files with O_DIRECT, which tmpfs
  # accepts from Linux 6.6 on: /dev/shm there, else a directory on local disk
  uname -r | tee "$out/kernel.txt"
  fsdir=/dev/shm/xavier-bench-vllm-fs
  python3 -c "import sys,platform; v=tuple(int(x) for x in platform.release().split('.')[:2]); sys.exit(v < (6, 6))" \
    || fsdir=/tmp/xavier-bench-vllm-fs
  echo "fs tier in $fsdir" | tee -a "$out/kernel.txt"
  python3 -c "import nixl" > "$out/nixl-import.txt" 2>&1; echo "nixl import rc $?" >> "$out/nixl-import.txt"
  timeout 570 python3 benchmarks/serving_bench.py --device cuda --shape qwen2.5-0.5b \
    --prefix-tokens 8192 --concurrency 1,8,32 --groups 32 --max-tokens 32 \
    --steady-state --peer-fs-dir "$fsdir" \
    --modes "${XAVIER_BENCH_MODES:-plain,local-hit,vllm-offload-fs,batched}" ${XAVIER_BENCH_ARGS:-} \
    --out "$out/serving_bench-cuda-qwen2.5-0.5b-peers.json" 2>&1 \
    | grep --line-buffered -v "it/s]" > "$out/serving_bench-peers.log"
  rc=$((rc | PIPESTATUS[0]))
  grep -E "^\[serving|^(plain|local-hit|vllm-offload-fs|batched)|^  |tokens equal" \
    "$out/serving_bench-peers.log" | head -60
fi
if only tp; then
  # issue #22: tensor-parallel replicas (needs two GPUs: nvidia-h200-x2)
  XAVIER_TEST_DEVICE=cuda timeout "${XAVIER_TEST_PART_TIMEOUT:-330}" python3 -m pytest -v -s \
    -p no:cacheprovider tests/test_tp_e2e.py 2>&1 | tee "$out/e2e-tp2-cuda.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if only tpbench; then
  timeout 570 python3 benchmarks/serving_bench.py --device cuda --shape qwen2.5-0.5b --tp 2 \
    --prefix-tokens 8192 --concurrency 1,8,32 --groups 32 --max-tokens 32 --steady-state \
    --modes "${XAVIER_BENCH_MODES:-plain,none,batched}" ${XAVIER_BENCH_ARGS:-} \
    --out "$out/serving_bench-cuda-qwen2.5-0.5b-tp2.json" 2>&1 \
    | grep --line-buffered -v "it/s]" > "$out/serving_bench-tp2.log"
  rc=$((rc | PIPESTATUS[0]))
  grep -E "^\[serving|^(plain|local-hit|none|batched)" "$out/serving_bench-tp2.log"
fi
exit "$rc"
