"""Engine overhead: a hand-written torch loop vs the Engine, same model, data and steps, 2 processes.

Pairs: hand-written DDP vs Engine(strategy="ddp"); hand-written FSDP2 vs Engine(strategy="zero3").
The four variants run interleaved, round after round, so drifts in machine load hit them all alike;
the figure per variant is the median step time over all timed steps after warm-up.

    python benchmarks/engine_overhead.py [--rounds 8] [--steps 10] [--warmup 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import multigpu as mg
from multigpu.launch.launcher import LaunchConfig, launch

HIDDEN, BLOCKS, BATCH, SAMPLES = 1024, 4, 32, 8192


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, HIDDEN, generator=generator), torch.randint(0, 10, (SAMPLES,)))


def endless(make_iter: Callable[[int], Iterator]) -> Iterator:
    epoch = 0
    while True:
        yield from make_iter(epoch)
        epoch += 1


def hand_written(kind: str) -> tuple[Callable[[], None], Iterator]:
    torch.manual_seed(0)
    model = Net()
    if kind == "ddp":
        model = DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)

    def epoch_iter(epoch: int) -> Iterator:
        sampler.set_epoch(epoch)
        return iter(DataLoader(dataset, batch_size=BATCH, sampler=sampler))

    batches = endless(epoch_iter)

    def step() -> None:
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, batches


def with_engine(strategy: str) -> tuple[Callable[[], None], Iterator]:
    engine = mg.Engine(strategy=strategy, seed=0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(data(), batch_size=BATCH, shuffle=True)
    batches = endless(lambda epoch: iter(loader))

    def step() -> None:
        x, y = next(batches)
        with engine.accumulate(model):
            engine.backward(nn.functional.cross_entropy(model(x), y))
        engine.step(optimizer)

    return step, batches


def worker(rounds: int, steps: int, warmup: int, out: str | None) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # the Engine joins this group
    variants = {
        "hand-written DDP": hand_written("ddp"),
        "Engine ddp": with_engine("ddp"),
        "hand-written FSDP2": hand_written("fsdp"),
        "Engine zero3": with_engine("zero3"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step, _ in variants.values():
        for _ in range(warmup):
            step()
    names = list(variants)
    for round_index in range(rounds):
        # Rotate the order each round so no variant always runs first (cache and scheduler effects).
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step, _ = variants[name]
            dist.barrier()
            for _ in range(steps):
                start = time.perf_counter()
                step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # time the work, not its launch
                times[name].append(time.perf_counter() - start)
    if dist.get_rank() != 0:
        return
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"\n{'variant':<20} {'median step':>12} {'timed steps':>12}")
    for name, value in medians.items():
        print(f"{name:<20} {value * 1000:>10.2f}ms {len(times[name]):>12}")
    ratios = {
        "Engine ddp / hand-written DDP": medians["Engine ddp"] / medians["hand-written DDP"],
        "Engine zero3 / hand-written FSDP2": medians["Engine zero3"] / medians["hand-written FSDP2"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f}  ({(ratio - 1) * 100:+.1f}%)")
    if out:
        with open(out, "w") as file:
            json.dump({"median_step_s": medians, "ratios": ratios, "world_size": dist.get_world_size()}, file, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.rounds, args.steps, args.warmup, args.json)
        return
    forwarded = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    forwarded += ["--json", args.json] if args.json else []
    raise SystemExit(launch(LaunchConfig(nproc=args.nproc), [__file__, *forwarded]))


if __name__ == "__main__":
    main()
