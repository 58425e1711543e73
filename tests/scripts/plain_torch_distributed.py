"""A plain torch.distributed training script: process group from the launcher's environment, DDP, AdamW.

    torchrun --nproc-per-node 2 plain_torch_distributed.py OUTDIR

Each process writes OUTDIR/rank{RANK}.json: the world size and rank it saw, the samples it trained on, and its
parameters before and after training.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main() -> None:
    outdir = sys.argv[1]
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    inputs = torch.randn(32, 4)
    targets = inputs @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.25
    data = TensorDataset(torch.arange(32), inputs, targets)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)

    model = DistributedDataParallel(
        nn.Linear(4, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    initial = flat(model.module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    seen: list[int] = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for index, x, y in loader:
            seen += index.tolist()
            loss = nn.functional.mse_loss(model(x.to(device)).squeeze(-1), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    record = {
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "samples": seen,
        "initial": initial,
        "final": flat(model.module),
    }
    with open(os.path.join(outdir, f"rank{dist.get_rank()}.json"), "w") as file:
        json.dump(record, file)
    # Drop DDP before the group it uses. Destroyed the other way round, the group dies with DDP's reducer, whose
    # destructor holds the GIL while it joins gloo's threads, one of which may need the GIL to release a finished
    # collective: a deadlock at the script's last line (seen once in about 30 runs on a loaded 2-core machine).
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
