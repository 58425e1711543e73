"""A plain Lightning script: a LightningModule and Trainer() with its default accelerator, devices and strategy.

    torchrun --nproc-per-node 2 lightning_script.py OUTDIR

Each process writes OUTDIR/rank{RANK}.json: the world size and global rank the Trainer reported, the samples it
trained on, and its parameters before and after training.
"""

import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seen: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.seen += index.tolist()
        return nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()]).tolist()


def main() -> None:
    outdir = sys.argv[1]
    torch.manual_seed(0)
    inputs = torch.randn(32, 4)
    targets = inputs @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.25
    loader = DataLoader(TensorDataset(torch.arange(32), inputs, targets), batch_size=4, shuffle=False)
    model = Regression()
    initial = flat(model)
    trainer = L.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(model, loader)
    record = {
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        "torch_world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else None,
        "samples": model.seen,
        "initial": initial,
        "final": flat(model),
    }
    # Named by the launcher's RANK: if the Trainer ran each process alone, both would call themselves rank 0.
    with open(os.path.join(outdir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as file:
        json.dump(record, file)


if __name__ == "__main__":
    main()
