#!/usr/bin/env bash
# The whole test suite: set-up, lint, then pytest. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check --quiet src tests benchmarks
# Two test files at a time: a test spends much of its time starting processes and waiting on them, and the
# other file's fills those gaps (each file in one worker, so its shared launches and fixtures run once).
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
