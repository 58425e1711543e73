"""Engine overhead: a hand-written torch loop vs the Engine (and Accelerate), same model, data and steps, 2 processes.

For each width (a 4-block residual MLP, 64 and 1024 wide by default), in one launch:

  raw DDP          DistributedDataParallel, DataLoader + DistributedSampler, AdamW
  Engine ddp       Engine(strategy="ddp"): engine.setup, engine.dataloader, accumulate, backward, step
  Accelerate ddp   accelerator.prepare, accelerator.backward (only where accelerate is installed)
  raw FSDP2        fully_shard on each block and the root, the same loader and optimizer
  Engine zero3     Engine(strategy="zero3"), the Engine loop above

All variants run interleaved, a few steps each per round (their order rotated each round), so that drifts in the
machine's load hit them all alike; each variant's figure is the median step time over all its timed steps after
warm-up. The fixed cost per step is what the Engine (or Accelerate) adds to every step whatever the model: the
median over rounds of its difference from the raw loop in the same round.

Beside the wall time, the process's CPU time per step (all its threads: gloo's, the heartbeat's), which a machine
shared with other work disturbs far less: the processes wait for each other in every collective, and a wait is no
CPU time.

    python -m multigpu run -n 2 benchmarks/engine_overhead.py [--rounds 30] [--steps 10] [--warmup 10]
    python benchmarks/engine_overhead.py [...]         # launches itself on --nproc processes (default 2)
    torchrun --nproc-per-node 2 benchmarks/engine_overhead.py [...]
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

BLOCKS, BATCH, SAMPLES, CLASSES = 4, 32, 8192, 10
Step = Callable[[], None]


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(BLOCKS))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def data(width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, width, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (SAMPLES,), generator=generator))


def endless(make_iter: Callable[[int], Iterator]) -> Iterator:
    epoch = 0
    while True:
        yield from make_iter(epoch)
        epoch += 1


def raw(kind: str, width: int) -> Step:
    torch.manual_seed(0)
    model = Net(width)
    if kind == "ddp":
        model = DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = data(width)
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

    return step


def with_engine(strategy: str, width: int) -> Step:
    engine = mg.Engine(strategy=strategy, seed=0)
    model = Net(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(data(width), batch_size=BATCH, shuffle=True)
    batches = endless(lambda epoch: iter(loader))

    def step() -> None:
        x, y = next(batches)
        with engine.accumulate(model):
            engine.backward(nn.functional.cross_entropy(model(x), y))
        engine.step(optimizer)

    return step


def with_accelerate(width: int) -> Step:
    from accelerate import Accelerator

    threads = torch.get_num_threads()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # joins the process group already there
    torch.set_num_threads(threads)  # accelerate sets its own where OMP_NUM_THREADS is unset: keep one setting for all
    torch.manual_seed(0)
    model = Net(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(data(width), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = endless(lambda epoch: iter(loader))

    def step() -> None:
        x, y = next(batches)
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


# (name, baseline it is compared with or None, what builds it)
def variants(widths: list[int], accelerate: bool) -> list[tuple[str, str | None, Callable[[], Step]]]:
    made: list[tuple[str, str | None, Callable[[], Step]]] = []
    for w in widths:
        made += [
            (f"raw DDP {w}", None, lambda w=w: raw("ddp", w)),
            (f"Engine ddp {w}", f"raw DDP {w}", lambda w=w: with_engine("ddp", w)),
        ]
        if accelerate:
            made.append((f"Accelerate ddp {w}", f"raw DDP {w}", lambda w=w: with_accelerate(w)))
        made += [
            (f"raw FSDP2 {w}", None, lambda w=w: raw("fsdp", w)),
            (f"Engine zero3 {w}", f"raw FSDP2 {w}", lambda w=w: with_engine("zero3", w)),
        ]
    return made


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # the Engine joins this group
    accelerate = has_accelerate() and not args.no_accelerate
    specs = variants([int(w) for w in args.widths.split(",")], accelerate)
    steps = {name: build() for name, _, build in specs}
    # Per variant, per round, its steps' (wall, CPU) seconds.
    times: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    names = list(steps)
    for round_index in range(args.rounds):
        # Rotate the order each round so no variant always runs first (cache and scheduler effects).
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step, measured = steps[name], []
            dist.barrier()  # every rank starts the variant's steps together, as a loop's steps do
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # time the work, not its launch
                measured.append((time.perf_counter() - start, time.process_time() - start_cpu))
            times[name].append(measured)
    if dist.get_rank() == 0:
        report(specs, times, args)


def report(specs: list, times: dict[str, list[list[tuple[float, float]]]], args: argparse.Namespace) -> None:
    """Per variant: the median step, its ratio to the raw loop's median, and the fixed cost: the median over rounds
    of the difference from the raw loop in the same round (paired, so that the machine's load at the time cancels)."""
    print(f"\n{dist.get_world_size()} processes, {args.rounds} rounds x {args.steps} timed steps per variant")
    columns = f"{'/ raw':>6} {'fixed cost':>11}"
    print(f"{'variant':<20} {'ms/step':>8} {columns}   {'CPU ms':>8} {columns}")
    rows = {}
    for name, baseline, _ in specs:
        row = rows[name] = {}
        line = f"{name:<20}"
        for index, clock in enumerate(("wall", "cpu")):
            median = statistics.median(step[index] for steps in times[name] for step in steps)
            ratio = extra = None
            if baseline:
                ratio = median / statistics.median(step[index] for steps in times[baseline] for step in steps)
                rounds = zip(times[name], times[baseline], strict=True)
                extra = 1e6 * statistics.median(
                    statistics.median(s[index] for s in mine) - statistics.median(s[index] for s in base)
                    for mine, base in rounds
                )
            row.update({f"{clock}_s": median, f"{clock}_ratio": ratio, f"{clock}_fixed_cost_us": extra})
            line += f" {median * 1000:>8.2f} {f'{ratio:.3f}' if ratio else '':>6} "
            line += f"{f'{extra:+.0f} µs' if extra is not None else '':>11}  "
        print(line.rstrip())
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"variants": rows, "world_size": dist.get_world_size(), "rounds": args.rounds}, file, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first (default 10)")
    parser.add_argument("--widths", default="64,1024", help="MLP widths, comma-separated (default 64,1024)")
    parser.add_argument("--no-accelerate", action="store_true", help="leave Accelerate out even where installed")
    parser.add_argument("--nproc", type=int, default=2, help="processes, when it launches itself (default 2)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    forwarded = [f"--rounds={args.rounds}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    forwarded += [f"--widths={args.widths}"] + (["--no-accelerate"] if args.no_accelerate else [])
    forwarded += [f"--json={args.json}"] if args.json else []
    raise SystemExit(launch(LaunchConfig(nproc=args.nproc), [__file__, *forwarded]))


if __name__ == "__main__":
    main()
