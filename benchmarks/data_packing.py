"""Real (non-padding) tokens per second, packed against padded: SmolLM2-135M LoRA fine-tuning under ddp on 2
processes, side by side in one run, on two real chat data sets of very different lengths:
- conversations: chitchat's 4,018 conversations, whole (median 436 tokens);
- exchanges: each user turn of those conversations with the answer to it, one record each (20,000 of them, a
  median of about 60 tokens: the length of most instruction data).

    python benchmarks/data_packing.py [--seq-len 512] [--batch-size 2] [--steps 6] [--warmup 2] [--nproc 2]

Each mode is one launch of `--nproc` processes of the finetune recipe's own parts (its build, its loader, its loss);
after `--warmup` optimizer steps, `--steps` steps are timed. Real tokens are the sequences' tokens before any
padding (a packed sequence's documents, or a record's own tokens), summed over the ranks; target tokens are those
the loss learns (the assistant turns); filled is real tokens over the batches' slots (rows x width). Padded: each
conversation alone in a row, padded to the longest of its batch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from multigpu.launch.launcher import LaunchConfig, launch


def counting(collate: Any) -> Any:
    """The collate function, also counting the batch's real tokens (before it pads them)."""

    def collate_and_count(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = collate(samples)
        batch["real_tokens"] = torch.tensor(sum(len(sample["input_ids"]) for sample in samples))
        return batch

    return collate_and_count


def exchanges(count: int) -> list[dict]:
    """The first `count` exchanges (a user turn and the assistant turn answering it) of chitchat's conversations."""
    from multigpu.data import data_files

    records = []
    for _, messages in data_files.read("chitchat").examples:
        for first, second in itertools.pairwise(messages):
            answered = second["content"].strip() and first["content"].strip()
            if first["role"] == "user" and second["role"] == "assistant" and answered:
                records.append({"messages": [first, second]})
    return records[:count]


def worker(data: str, packing: bool, seq_len: int, batch_size: int, warmup: int, steps: int, out: str) -> None:
    from multigpu.recipes.common import recipe_engine
    from multigpu.recipes.finetune import FinetuneConfig, build, lm_loss, model_inputs

    config = FinetuneConfig(model="smollm2", method="lora", data=data, seq_len=seq_len, packing=packing,
                            multi_gpu="ddp", batch_size=batch_size, log_every=0, save_dir=out)  # fmt: skip
    engine = recipe_engine(config)
    model, optimizer, _, data = build(config, engine)
    loss_fn = lm_loss(engine, model)
    loader = engine.dataloader(data.train, batch_size=batch_size, collate_fn=counting(data.collate_fn()))
    totals, done, start = torch.zeros(3, dtype=torch.float64), 0, time.perf_counter()
    for batch in loader:
        engine.forward_backward(model, model_inputs(batch), batch["labels"], loss_fn)
        if done >= warmup:
            counts = (batch["real_tokens"], (batch["labels"] != -100).sum(), batch["input_ids"].numel())
            totals += torch.tensor([float(count) for count in counts], dtype=torch.float64)
        if engine.step(optimizer):
            done += 1
            if done == warmup:
                start = time.perf_counter()
            if done == warmup + steps:
                break
    seconds = time.perf_counter() - start
    totals = engine.reduce(totals, op="sum")
    if engine.is_main_process:
        rows = len(data.train)
        real, targets, slots = totals.tolist()
        result = {"sequences": rows, "real": real, "targets": targets, "slots": slots, "seconds": seconds}
        Path(out, "result.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per process per step")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps timed")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timing")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = [str(v) for v in (args.seq_len, args.batch_size, args.warmup, args.steps)]
    if args.worker:
        worker(args.worker[0], args.worker[1] == "packed", *map(int, shape), args.worker[2])
        return
    print(f"SmolLM2-135M LoRA, --seq-len {args.seq_len}, {args.batch_size} sequences per process, ddp on "
          f"{args.nproc} processes; {args.steps} steps timed after {args.warmup}")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        pairs = Path(folder, "exchanges.jsonl")
        pairs.write_text("".join(json.dumps(record) + "\n" for record in exchanges(20_000)))
        for name, data in (("conversations", "chitchat"), ("exchanges", str(pairs))):
            for mode in ("padded", "packed"):
                out = Path(folder, name, mode)
                argv = [__file__, "--seq-len", shape[0], "--batch-size", shape[1], "--warmup", shape[2]]
                argv += ["--steps", shape[3], "--worker", data, mode, str(out)]
                if launch(LaunchConfig(nproc=args.nproc), argv):
                    sys.exit(1)
                rows.append((name, mode, json.loads((out / "result.json").read_text())))
    print(f"{'data':<13} {'mode':<7} {'sequences':>9} {'real tok/step':>13} {'filled':>6} {'s/step':>7} "
          f"{'real tok/s':>10} {'target tok/s':>12}")  # fmt: skip
    for name, mode, r in rows:
        step, filled = r["seconds"] / args.steps, r["real"] / r["slots"]
        print(f"{name:<13} {mode:<7} {r['sequences']:>9,} {r['real'] / args.steps:>13,.0f} {filled:>6.0%} "
              f"{step:>7.2f} {r['real'] / r['seconds']:>10,.0f} {r['targets'] / r['seconds']:>12,.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
