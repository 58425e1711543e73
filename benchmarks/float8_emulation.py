"""Float8's effect on what is learned: a small Llama trained plain, with float8 tensorwise and with float8 rowwise,
the same batches and seed, side by side, beside the plain model in fp32 (how far the precision alone moves it). On
a CPU float8 is emulated (the same casts and scales, the products in the operands' width), so this measures
float8's rounding, not its speed: speed needs a GPU of compute capability 8.9 or newer.

The data is a fixed random Markov chain over the vocabulary (each token followed by one of 4 likely tokens), so
the loss falls from ln(vocab) towards ln(4) and the three runs can be compared at every step.

    python benchmarks/float8_emulation.py [--steps 80] [--precision bf16-mixed] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import multigpu as mg

VOCAB, SEQ, BATCH, SUCCESSORS = 512, 128, 8, 4


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=generator)
    out = []
    for _ in range(steps):
        tokens = [torch.randint(0, VOCAB, (BATCH,), generator=generator)]
        for _ in range(SEQ):
            pick = torch.randint(0, SUCCESSORS, (BATCH,), generator=generator)
            tokens.append(successors[tokens[-1], pick])
        out.append(torch.stack(tokens, dim=1))
    return out


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def train(float8: str, precision: str, data: list[torch.Tensor]) -> tuple[list[float], float]:
    """Each step's loss, and the mean seconds per step."""
    engine = mg.Engine("single", float8=float8, precision=precision, seed=0)
    net, started = model(), time.perf_counter()
    optimizer = torch.optim.AdamW(net.parameters(), lr=5e-3)
    net, optimizer = engine.setup(net, optimizer)
    losses = []
    for tokens in data:
        logits = net(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step(optimizer)
        losses.append(loss.item())
    return losses, (time.perf_counter() - started) / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    data = batches(args.steps)
    runs = {recipe: train(recipe, args.precision, data) for recipe in ("none", "tensorwise", "rowwise")}
    runs["plain fp32"] = train("none", "32", data)
    plain = runs["none"][0]
    print(f"\nLlama 4 x 256, vocabulary {VOCAB}, {BATCH} x {SEQ} tokens a step, AdamW, {args.precision}")
    print("| step | plain | float8 tensorwise | float8 rowwise | plain fp32 |\n| ---: | ---: | ---: | ---: | ---: |")
    for step in sorted({s for s in (1, 10, args.steps // 4, args.steps // 2, args.steps) if 1 <= s <= args.steps}):
        cells = [f"{runs[r][0][step - 1]:.4f} ({rel(runs[r][0][step - 1], plain[step - 1]):+.2%})" for r in runs]
        print(f"| {step} | {' | '.join([f'{plain[step - 1]:.4f}', *cells[1:]])} |")
    for recipe in ("tensorwise", "rowwise", "plain fp32"):
        worst = max(abs(rel(a, b)) for a, b in zip(runs[recipe][0], plain, strict=True))
        print(f"{recipe}: largest deviation from plain over {args.steps} steps {worst:.2%}")
    print("seconds per step (emulated float8 is slower on a CPU; not a speed figure): ", end="")
    print(", ".join(f"{recipe} {seconds:.2f}" for recipe, (_, seconds) in runs.items()))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({recipe: {"losses": losses, "seconds_per_step": s} for recipe, (losses, s) in runs.items()}, out)


def rel(found: float, expected: float) -> float:
    return (found - expected) / expected


if __name__ == "__main__":
    main()
