#!/usr/bin/env bash
# The main job: set-up, then the sensor-activity trainer on 2 processes. Extra flags go to `multigpu train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/multigpu train --nproc 2 "$@"
