#!/usr/bin/env bash
# The whole test run: lint, types, then every test (slow ones included).
# Run after scripts/setup.sh.  Extra arguments go to pytest.
#   --fast   the inner loop: lint, types and every test that starts no vLLM engine and no
#            Xinference server (pytest -m "not engine", on two pytest-xdist workers); a test
#            that starts one anyway fails (it lacks the marker)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=/dev/null
. "${VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# two pytest-xdist workers: one runs every engine test, one after the other (they share
# their engines: tests/support/worlds.py), the other every other test meanwhile
select=(-n 2 --dist loadgroup)
if [[ "${1:-}" == "--fast" ]]; then
    shift
    export XAVIER_TEST_FAST=1
    # worksteal: an idle worker takes tests queued on the other (the slow ones are
    # minutes of fresh interpreters: with plain "load" one worker ended ~1 min after the other)
    select=(-m "not engine" -n 2 --dist worksteal)
fi
echo "[test] ruff"
ruff check .
echo "[test] mypy"
mypy xinference/model/llm/vllm/xavier _xinference_xavier_overlay.py
echo "[test] pytest (${select[*]})"
python -m pytest -p no:cacheprovider --durations=15 "${select[@]}" "$@" tests
