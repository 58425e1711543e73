"""LoRA fine-tuning throughput: `multigpu finetune --method lora` vs the Hugging Face Trainer + peft, one CPU process.

Both sides get the same model and adapter (lm_models.load_model after torch.manual_seed(seed)), the same packed
Shakespeare blocks in the same order, fp32, AdamW (no weight decay) under finetune's warm-up/cosine schedule, no
gradient clipping, and the same loss: summed cross-entropy over the (already shifted) labels / target tokens.
A step is timed from the end of the previous optimizer step to the end of its own, data loading included:
multigpu by its Engine (metrics.jsonl, logged every --warmup steps), the Trainer by a callback at on_step_end.
Steps 1..--warmup are not timed on either side. Runs alternate sides; the figure per side is the median run.
multigpu runs in-process with its validation passes skipped (they lie outside the timed steps).
Threads: torch's default on both sides (printed).

    python benchmarks/finetune_vs_hf_trainer.py [--model smollm2] [--steps 30] [--warmup 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils.data import Subset

from multigpu.data import lm_data
from multigpu.engine.lr_schedule import warmup_cosine
from multigpu.models import lm_models
from multigpu.recipes import finetune as ft


def config(args: argparse.Namespace, save_dir: str) -> ft.FinetuneConfig:
    return ft.FinetuneConfig(
        model=args.model, data="shakespeare", method="lora", multi_gpu="auto", seq_len=args.seq_len,
        batch_size=args.batch_size, lr=args.lr, max_steps=args.steps, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
        precision="32", save_dir=save_dir, resume="none", log_every=args.warmup, seed=args.seed,
    )  # fmt: skip


def run_multigpu(args: argparse.Namespace) -> tuple[float, int, float]:
    """(tokens/s over steps warmup+1..steps, steps timed, first training step's loss per token)."""
    first: list[float] = []
    token_loss = ft.token_loss

    def recording(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss, count = token_loss(model, batch)
        if model.training and not first:  # the validation pass runs in eval mode (and is skipped here anyway)
            first.append(loss.item() / count.item())
        return loss, count

    with (
        tempfile.TemporaryDirectory() as tmp,
        mock.patch.object(ft, "token_loss", recording),
        mock.patch.object(ft, "evaluate", lambda *_: float("nan")),
    ):
        ft.finetune(config(args, tmp))
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "perf/tokens_per_s" in r and r["step"] > args.warmup]
    seconds = [r["perf/step_time_s"] * args.warmup for r in timed]  # each record covers --warmup steps
    tokens = sum(r["perf/tokens_per_s"] * s for r, s in zip(timed, seconds, strict=True))
    return tokens / sum(seconds), len(timed) * args.warmup, first[0]


def run_trainer(args: argparse.Namespace) -> tuple[float, int, float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    tokenizer = lm_models.load_tokenizer(args.model)
    data = lm_data.load(lm_data.DataSettings(seq_len=args.seq_len, packing=False), tokenizer)
    # The order multigpu's loader uses for epoch 0 on one process (randperm seeded with seed + epoch).
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(args.seed)).tolist()
    torch.manual_seed(args.seed)  # as the Engine does before building: the same LoRA initialisation
    model = lm_models.load_model(args.model, "lora", args.lora_r, args.lora_alpha)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    # multigpu's schedule over samples, in steps: with one process and a fixed batch every step has as many samples.
    warmup = ft.FinetuneConfig.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, args.steps))
    counts: list[int] = []
    first: list[float] = []
    stamps: list[float] = []

    def summed_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = nn.functional.cross_entropy(
            outputs.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        count = int((labels != -100).sum())
        counts.append(count)
        if not first:
            first.append(loss.item() / count)
        return loss / count

    class Stamps(TrainerCallback):
        def on_step_end(self, *_, **__) -> None:
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.batch_size, max_steps=args.steps, learning_rate=args.lr,
            weight_decay=0.0, max_grad_norm=0.0, logging_steps=args.warmup, save_strategy="no", report_to=[],
            dataloader_num_workers=0, use_cpu=True, seed=args.seed, remove_unused_columns=False,
            train_sampling_strategy="sequential", disable_tqdm=True,
        )  # fmt: skip
        Trainer(
            model=model, args=training_args, train_dataset=Subset(data.train, order),
            data_collator=functools.partial(lm_data.collate, pad_id=tokenizer.pad_token_id),
            optimizers=(optimizer, scheduler), compute_loss_func=summed_loss, callbacks=[Stamps()],
        ).train()  # fmt: skip
    timed = args.steps - args.warmup
    return sum(counts[args.warmup : args.steps]) / (stamps[args.steps - 1] - stamps[args.warmup - 1]), timed, first[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 or tiny (default smollm2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per block (default 128)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (default 16)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps, >= 2 (default 5)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed for both sides (default 0)")
    args = parser.parse_args()
    if args.warmup < 2 or args.steps <= args.warmup or args.steps % args.warmup:
        parser.error("--warmup must be 2 or more and --steps a larger multiple of it (multigpu logs every --warmup).")
    sides = {"multigpu finetune": run_multigpu, "HF Trainer + peft": run_trainer}
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name in list(sides)[:: 1 if repeat % 2 == 0 else -1]:
            results[name].append(sides[name](args))
            print(f"[repeat {repeat + 1}] {name}: {results[name][-1][0]:,.1f} tokens/s", flush=True)
    print(
        f"\n{args.model}, seq_len {args.seq_len}, batch {args.batch_size}, "
        f"LoRA r {args.lora_r} alpha {args.lora_alpha}, lr {args.lr}, fp32, "
        f"{args.steps} steps ({args.warmup} untimed), {args.repeats} repeat(s), {torch.get_num_threads()} torch threads"
    )
    print(f"{'framework':<20} {'steps timed':>11} {'tokens/s (median)':>18} {'runs':>22} {'first-step loss':>16}")
    medians = {}
    for name, runs in results.items():
        medians[name] = statistics.median(r[0] for r in runs)
        each = "/".join(f"{r[0]:,.0f}" for r in runs)
        print(f"{name:<20} {runs[0][1]:>11} {medians[name]:>18,.1f} {each:>22} {runs[0][2]:>16.6f}")
    losses = [runs[0][2] for runs in results.values()]
    print(f"first-step loss difference: {abs(losses[0] - losses[1]):.2e}")
    ratio = medians["multigpu finetune"] / medians["HF Trainer + peft"]
    print(f"multigpu / Trainer tokens/s: {ratio:.3f}  ({(ratio - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
