"""Optimizers side by side under zero3 on 2 processes: loss, step time, optimizer memory, and the planner's figure.

    python benchmarks/optimizers.py [--steps N] [--skip-smollm2] [--lora-steps N]

Part 1, the tiny Llama fine-tuned in full on Shakespeare: each optimizer's validation loss after N steps (the
command `multigpu finetune` a user types), then `multigpu bench` of the same run for its step time, its optimizer
states per rank and per parameter, and the bytes Muon all-gathers per step. One learning rate for all (3e-3, with
Muon's lr scaled to match AdamW's update size, its default).

Part 2, SmolLM2-135M fine-tuned in full: `multigpu bench` for each optimizer's states per rank and peak memory per
rank, beside `multigpu plan`'s optimizer figure for zero3 on 2 GPUs at the same precision (fp32 master weights).

Part 3, SmolLM2-135M with LoRA adapters (r 8 on every linear layer, the recipe's default lr): Muon against AdamW,
the validation loss after --lora-steps steps and the step time. Muon orthogonalises each adapter matrix (A is
r x in, B out x r), the frozen weights train with neither.

Each run is the real command in a fresh process; keep the machine otherwise idle for the step times.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OPTIMIZERS = ("adamw", "muon", "adamw-bf16", "adamw-8bit", "adamw-4bit")
TINY = ["--model", "tiny", "--method", "full", "--seq-len", "128", "--batch-size", "4", "--lr", "3e-3"]
SMOLLM2 = ["--model", "smollm2", "--method", "full", "--seq-len", "128", "--batch-size", "1"]
SMOLLM2_LORA = ["--model", "smollm2", "--method", "lora", "--seq-len", "128", "--batch-size", "2"]
ZERO3 = ["--multi-gpu", "zero3", "--nproc", "2"]


def multigpu(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "multigpu", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"multigpu {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def losses(model: list[str], optimizer: str, steps: int, workdir: Path) -> list[float]:
    """The validation losses before and after `steps` steps."""
    out = multigpu(
        "finetune", *model, *ZERO3, "--optimizer", optimizer, "--max-steps", str(steps), "--eval-batches", "8",
        "--save-dir", str(workdir / f"finetune-{model[1]}-{model[3]}-{optimizer}"), "--save-every", "0",
        "--log-every", "0",
    )  # fmt: skip
    return [float(value) for value in re.findall(r"validation loss ([0-9.]+)", out)]


def benched(model: list[str], optimizer: str, steps: int, workdir: Path) -> dict:
    """bench's zero3 cell on 2 processes for `optimizer`: step time, states per rank and per parameter, gathers."""
    out = workdir / f"bench-{model[1]}-{optimizer}"
    multigpu(
        "bench", "--nproc", "2", "--strategies", "zero3", "--optimizer", optimizer, "--steps", str(steps),
        "--warmup", "1", "--repeats", "1", "--no-comm-share", "--out", str(out),
        "-m", "multigpu.recipes.finetune", *model, "--resume", "none", "--epochs", "1000", "--log-every", "0",
        "--eval-batches", "1", "--save-dir", str(out / "run"),
    )  # fmt: skip
    return json.loads((out / "bench.json").read_text())["cells"][-1]


def planned_optimizer_mib(optimizer: str) -> float:
    """The planner's optimizer states per GPU for SmolLM2-135M under zero3 on 2 GPUs, fp32 masters (MiB)."""
    plan = json.loads(multigpu("plan", "--model", "smollm2-135m", "--gpus", "2", "--precision", "32",
                               "--optimizer", optimizer, "--json"))  # fmt: skip
    row = next(row for row in plan["strategies"] if row["strategy"] == "zero3")
    return row["optimizer"] / 2**20


def tiny_llama(steps: int, workdir: Path) -> None:
    print(f"tiny Llama, full fine-tune on Shakespeare, zero3 on 2 processes, {steps} steps at lr 3e-3")
    print("| optimizer | val loss before -> after | step ms | optimizer MB per rank | state B/param | "
          "Muon gather MB/step |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for optimizer in OPTIMIZERS:
        before, *_, after = losses(TINY, optimizer, steps, workdir)
        cell = benched(TINY, optimizer, 10, workdir)
        print(
            f"| {optimizer} | {before:.4f} -> {after:.4f} | {cell['step_time_s']['median'] * 1e3:.0f} | "
            f"{' / '.join(f'{m:.1f}' for m in cell['optimizer_state_mb'])} | "
            f"{cell['state_bytes_per_param']:.2f} | {cell['optimizer_gather_mb']:.2f} |",
            flush=True,
        )


def smollm2_states(workdir: Path) -> None:
    print("\nSmolLM2-135M, full fine-tune, zero3 on 2 processes, fp32 masters; the planner's zero3 row beside it")
    print("| optimizer | state B/param | optimizer MB per rank | planner MB per rank | peak MB per rank |\n"
          "| --- | --- | --- | --- | --- |")  # fmt: skip
    for optimizer in OPTIMIZERS:
        cell = benched(SMOLLM2, optimizer, 2, workdir)
        peak = " / ".join(f"{m:,.0f}" for m in cell["peak_memory_mb"])
        print(
            f"| {optimizer} | {cell['state_bytes_per_param']:.2f} | "
            f"{' / '.join(f'{m:,.0f}' for m in cell['optimizer_state_mb'])} | "
            f"{planned_optimizer_mib(optimizer):,.0f} | {peak} |",
            flush=True,
        )


def smollm2_lora(steps: int, workdir: Path) -> None:
    print(f"\nSmolLM2-135M LoRA on Shakespeare, zero3 on 2 processes, {steps} steps at the recipe's lr")
    print("| optimizer | val loss before -> after | step ms | optimizer MB per rank | Muon gather MB/step |\n"
          "| --- | --- | --- | --- | --- |")  # fmt: skip
    for optimizer in ("adamw", "muon"):
        before, *_, after = losses(SMOLLM2_LORA, optimizer, steps, workdir)
        cell = benched(SMOLLM2_LORA, optimizer, 4, workdir)
        print(
            f"| {optimizer} | {before:.4f} -> {after:.4f} | {cell['step_time_s']['median'] * 1e3:.0f} | "
            f"{' / '.join(f'{m:.1f}' for m in cell['optimizer_state_mb'])} | {cell['optimizer_gather_mb']:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps for the loss of part 1")
    parser.add_argument("--skip-smollm2", action="store_true", help="part 1 only")
    parser.add_argument("--lora-steps", type=int, default=30, help="SmolLM2 LoRA steps for the loss of part 3")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 3")
    args = parser.parse_args()
    parts = set(args.parts.split(",")) - ({"2", "3"} if args.skip_smollm2 else set())
    with tempfile.TemporaryDirectory(prefix="optimizers-") as tmp:
        workdir = Path(tmp)
        if "1" in parts:
            tiny_llama(args.steps, workdir)
        if "2" in parts:
            smollm2_states(workdir)
        if "3" in parts:
            smollm2_lora(args.lora_steps, workdir)


if __name__ == "__main__":
    main()
