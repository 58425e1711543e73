"""Step time eager against per-block torch.compile (inductor), and the time the first compiled step takes.

    python benchmarks/compile_speed.py                     # tiny Llama full fine-tune and SmolLM2-135M LoRA
    python benchmarks/compile_speed.py --rows smollm2-lora --steps 10 --seq-len 512

Each row trains through the Engine (strategy single, fp32, AdamW) on random tokens in a process of its own, eager
and compiled interleaved, so the compiled runs start with inductor's cache as cold as a user's first run of that
model (each compiled process gets a fresh cache directory). The step times are medians after 2 warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROWS = {"tiny-full": ("tiny", "full"), "smollm2-lora": ("smollm2", "lora")}


def measure(model_name: str, method: str, compile: bool, steps: int, batch: int, seq: int) -> dict[str, float]:
    """In this process: the first step's seconds and the median of the steps after 2 more."""
    import torch

    import multigpu as mg
    from multigpu.models import lm_models

    engine = mg.Engine(strategy="single", compile=compile, seed=0)
    model = lm_models.load_model(model_name, method)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = engine.setup(model, torch.optim.AdamW(trainable, lr=1e-5))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step(optimizer)
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "step_s": statistics.median(times[3:])}


def run_row(row: str, compile: bool, args: argparse.Namespace) -> dict[str, float]:
    """measure() in a fresh process, with a cache of inductor's own."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        call = [sys.executable, __file__, "--measure", row, "--steps", str(args.steps)]
        call += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)] + (
            ["--compile"] if compile else []
        )
        out = subprocess.run(call, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*ROWS[args.measure], args.compile, args.steps, args.batch_size, args.seq_len)))
        return
    print(f"batch {args.batch_size} x {args.seq_len} tokens, fp32, one process; medians of {args.steps} steps")
    print(f"{'row':>14} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} {'first compiled step s':>22}")
    for row in args.rows.split(","):
        eager, compiled = run_row(row, False, args), run_row(row, True, args)
        speedup = eager["step_s"] / compiled["step_s"]
        print(
            f"{row:>14} {eager['step_s'] * 1e3:9.1f} {compiled['step_s'] * 1e3:12.1f} {speedup:8.2f} "
            f"{compiled['first_s']:22.1f}"
        )


if __name__ == "__main__":
    main()
