#!/usr/bin/env bash
# The whole test suite: set-up, lint, then pytest. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check --quiet src tests benchmarks
.venv/bin/python -m pytest "$@"
