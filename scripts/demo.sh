#!/usr/bin/env bash
# The main job: set-up, then a short demo training on 2 processes. Extra flags go to `multigpu demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/multigpu demo --nproc 2 "$@"
