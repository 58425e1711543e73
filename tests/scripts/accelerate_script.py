"""A plain accelerate training script: Accelerator(), prepare, accelerator.backward.

    accelerate launch --num-processes 2 accelerate_script.py OUTDIR

Each process writes OUTDIR/rank{RANK}.json: the number of processes and the index accelerate reported, the
samples it trained on, and its parameters before and after training.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()]).tolist()


def main() -> None:
    outdir = sys.argv[1]
    accelerator = Accelerator()
    torch.manual_seed(0)
    inputs = torch.randn(32, 4)
    targets = inputs @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.25
    loader = DataLoader(TensorDataset(torch.arange(32), inputs, targets), batch_size=4, shuffle=False)
    model = nn.Linear(4, 1)
    initial = flat(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    seen: list[int] = []
    for _ in range(2):
        for index, x, y in loader:
            seen += index.tolist()
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()

    accelerator.wait_for_everyone()
    record = {
        "world_size": accelerator.num_processes,
        "rank": accelerator.process_index,
        "torch_world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else None,
        "samples": seen,
        "initial": initial,
        "final": flat(accelerator.unwrap_model(model)),
    }
    # Named by the launcher's RANK: if accelerate ran each process alone, both would call themselves rank 0.
    with open(os.path.join(outdir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as file:
        json.dump(record, file)
    accelerator.end_training()


if __name__ == "__main__":
    main()
