#!/usr/bin/env bash
# The whole test suite: set-up, lint, then pytest. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check --quiet src tests benchmarks
# Each module byte-compiled the first time a process imports it, and kept: where PYTHONDONTWRITEBYTECODE is set,
# each of the suite's hundreds of processes would compile every module it imports, torch's included.
unset PYTHONDONTWRITEBYTECODE
# Two test files at a time: a test spends much of its time starting processes and waiting on them, and the
# other file's fills those gaps (each file in one worker, so its shared launches and fixtures run once). In
# collection order, which tests/conftest.py makes the longest first, so that the last to start are short:
# --no-loadscope-reorder, or pytest-xdist sorts the files by their number of tests instead.
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
