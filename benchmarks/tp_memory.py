"""What each rank holds under tensor parallelism, measured, beside what `multigpu plan --tp-size` predicts.

    multigpu run -n 3 benchmarks/tp_memory.py --model smollm2      # SmolLM2's 9 heads and 3 kv heads split by 3
    multigpu run -n 2 benchmarks/tp_memory.py --model tiny --strategy zero3 --tp-size 2   # or 4 processes, 2-D

Each rank sums the bytes of its local parameters, gradients and AdamW states after one optimizer step (DTensors
count their local shard) and rank 0 prints every rank's figures next to the planner's for the same layout. The
planner predicts one GPU's model states from the model's config alone, so the two must agree to the byte where its
arithmetic is right (the rows of the split layers, and what stays whole).
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.tensor import DTensor

import multigpu as mg
from multigpu.models import lm_models


def local_bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=("tiny", "smollm2"))
    parser.add_argument("--strategy", default="tp")
    parser.add_argument("--tp-size", type=int, default=None)
    args = parser.parse_args()
    engine = mg.Engine(strategy=args.strategy, tp_size=args.tp_size, seed=0)
    model = lm_models.load_model(args.model, "full")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.setup(model, optimizer)
    ids = torch.randint(0, 1000, (1, 16), device=engine.device)
    engine.forward_backward(model, {"input_ids": ids}, ids, lambda out, y: out.logits.float().mean())
    params = list(model.parameters())
    grads = local_bytes([p.grad for p in params])  # before the step, which frees them
    engine.step(optimizer)
    states = [value for state in optimizer.state.values() for value in state.values() if value.dim() > 0]
    measured = [local_bytes(params), grads, local_bytes(states)]
    ranks = [
        engine.reduce(torch.tensor(measured if engine.rank == r else [0, 0, 0]), "sum")
        for r in range(engine.world_size)
    ]
    if engine.is_main_process:
        tp = args.tp_size or engine.world_size
        nodes_gpus = {"gpus": engine.world_size, "precision": "32", "batch_size": 1, "seq_len": 16, "tp_size": tp}
        plan = mg.plan(str(lm_models.model_dir(args.model)), **nodes_gpus)
        row = next(s for s in plan.strategies if s.strategy in (args.strategy, "tp", "tp+pp"))
        predicted = [row.params, row.grads, row.optimizer]
        print(f"{args.model} under {args.strategy} (tp {tp}) on {engine.world_size} processes, MiB per rank:")
        print(f"{'':>10} {'params':>9} {'grads':>9} {'adamw':>9}")
        for rank, values in enumerate(ranks):
            print(f"{'rank ' + str(rank):>10} " + " ".join(f"{float(v) / 2**20:9.2f}" for v in values))
        print(f"{'plan':>10} " + " ".join(f"{v / 2**20:9.2f}" for v in predicted) + f"   ({row.strategy} row)")


if __name__ == "__main__":
    main()
