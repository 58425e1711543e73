"""Peak activation memory of one training step under each activation checkpointing mode, measured beside what
`multigpu plan --activation-checkpointing MODE` predicts for the same model, batch and sequence.

    python benchmarks/activation_memory.py                          # SmolLM2-135M, full fine-tune, seq 1024
    python benchmarks/activation_memory.py --model tiny --seq-len 256 --batch-size 2

One process, the Engine's single strategy, fp32. torch's MemTracker follows every tensor the step creates, on any
device: the activations' peak is its peak total less the parameters and the gradients, which a first step has
made (a training loop's steps after the first hold them throughout). On a GPU, offload moves what the blocks save
to host memory; on a CPU the host is the device, so offload's peak there is none's, and the planner's offload
figure (the device's memory) is compared on a GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import multigpu as mg
from multigpu.models import lm_models
from multigpu.transforms.recompute import MODES


def measure(model_name: str, mode: str, batch: int, seq: int) -> float:
    """Bytes of activations at the step's peak under `mode`."""
    engine = mg.Engine(strategy="single", activation_checkpointing=mode, seed=0)
    model = lm_models.load_model(model_name, "full")
    model, _ = engine.setup(model, None)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=engine.device)
    model(input_ids=ids, labels=ids).loss.backward()  # the gradients exist from here on, as in a training loop
    model.zero_grad(set_to_none=False)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss  # the logits go as the output does, before backward
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[engine.device]
    held = sum(value for kind, value in peak.items() if kind != "Total" and kind.value in ("Parameter", "Gradient"))
    return peak["Total"] - held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=("tiny", "smollm2"))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for mode in MODES:
        measured = measure(args.model, mode, args.batch_size, args.seq_len)
        plan = mg.plan(
            str(lm_models.model_dir(args.model)),
            precision="32",
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            activation_checkpointing=mode,
        )
        planned = next(row for row in plan.strategies if row.strategy == "single").activations
        rows.append({"mode": mode, "measured_mib": measured / 2**20, "planned_mib": planned / 2**20})
    print(f"{args.model}, full fine-tune, fp32, batch {args.batch_size} x {args.seq_len} tokens, one process:")
    print(f"{'mode':>10} {'measured MiB':>13} {'planned MiB':>12} {'planned/measured':>17}")
    for row in rows:
        ratio = row["planned_mib"] / row["measured_mib"]
        print(f"{row['mode']:>10} {row['measured_mib']:13.1f} {row['planned_mib']:12.1f} {ratio:17.2f}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
