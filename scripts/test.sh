#!/usr/bin/env bash
# The whole test run: lint, types, then every test (slow ones included).
# Run after scripts/setup.sh.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=/dev/null
. "${VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "[test] ruff"
ruff check .
echo "[test] mypy"
mypy xinference/model/llm/vllm/xavier _xinference_xavier_overlay.py
echo "[test] pytest (all markers)"
python -m pytest -p no:cacheprovider --durations=15 "$@" tests
