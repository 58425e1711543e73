"""The PyTorch DDP tutorial's way to start processes: the script spawns them itself and names the rendezvous.

    python ddp_spawn.py PORT

Two processes, started with torch.multiprocessing.spawn, each add their rank + 1 with an all_reduce; both print
the sum (3). Under `multigpu run -n 1` this script runs in the one worker, whose environment comes from torchrun.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def setup(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = sys.argv[1] if len(sys.argv) > 1 else "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def run(rank: int, world_size: int) -> None:
    setup(rank, world_size)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"spawned rank {rank} of {world_size}: sum {total.item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(WORLD_SIZE,), nprocs=WORLD_SIZE, join=True)
