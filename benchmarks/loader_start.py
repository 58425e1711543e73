"""How long the Engine's loader takes to its first batch, and per step after it, against the dataset's size.

    python benchmarks/loader_start.py [--sizes 1000000,10000000,1000000000] [--old-up-to 10000000] [--steps 200]

The dataset is indices only (sample i is i), so what is timed is the loader: its order, its split among ranks and
its batches, not reading data. Each size times rank 0's loader of a 2-process run (batch 12 per device, built in
this one process as `engine.dataloader` builds it) and reports the seconds from `iter(loader)` to the first batch,
then the mean seconds per batch over `--steps` more. "before" is the algorithm this loader replaced (multigpu up to
order version 1): a torch.randperm of the whole epoch, then every batch of the epoch planned as Batch records
before the first one; plan_epoch is reimplemented here, and timed up to `--old-up-to` samples (at 10^9 it needs
tens of GB). "len() s" is the time `len(loader)` takes (the old one planned the epoch again).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable

import torch
from torch.utils.data import DataLoader, Dataset

from multigpu.data.loader import Batch, DistributedLoader

BATCH, WORLD, RANK = 12, 2, 0


class Indices(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def old_batches(size: int) -> list[list[int]]:
    """Order version 1's plan, as multigpu's plan_epoch made it: the epoch's permutation as a list, then every
    global batch cut, split among the ranks and weighted, as Batch records, before the first batch."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(0)).tolist()
    global_batch = BATCH * WORLD
    slices = [order[pos : pos + global_batch] for pos in range(0, size, global_batch)]
    plan = []
    for chunk in slices:  # one accumulation step per window: every batch ends its window
        indices = chunk[RANK::WORLD]
        plan.append(Batch(indices, len(indices), len(chunk), len(indices) * WORLD / len(chunk), True))
    return [batch.indices for batch in plan]


def timed(make: Callable[[], Iterable], steps: int) -> tuple[float, float]:
    """Seconds to the first batch (making the iterator included), and mean seconds per batch after it."""
    start = time.perf_counter()
    batches = iter(make())
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return first, (time.perf_counter() - start) / steps


def new_loader(size: int) -> DistributedLoader:
    return DistributedLoader(
        Indices(size),
        batch_size=BATCH,
        shuffle=True,
        drop_last=False,
        num_workers=0,
        collate_fn=None,
        rank=RANK,
        world_size=WORLD,
        grad_accum_steps=1,
        seed=0,
        device=torch.device("cpu"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000,1000000000")
    parser.add_argument("--old-up-to", type=int, default=10**7)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'samples':>14} {'loader':>7} {'first batch s':>14} {'per step ms':>12} {'len() s':>9}")
    for size in [int(s) for s in args.sizes.split(",")]:
        rows = [("now", lambda size=size: new_loader(size))]
        if size <= args.old_up_to:
            rows.insert(0, ("before", lambda size=size: DataLoader(Indices(size), batch_sampler=old_batches(size))))
        for name, make in rows:
            first, per_step = timed(make, args.steps)
            start = time.perf_counter()
            if name == "now":
                len(new_loader(size))
            else:
                len(old_batches(size))  # the old len() planned the epoch too
            length = time.perf_counter() - start
            print(f"{size:>14,} {name:>7} {first:>14.4f} {per_step * 1000:>12.3f} {length:>9.4f}")


if __name__ == "__main__":
    main()
