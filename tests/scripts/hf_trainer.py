"""A plain HF transformers.Trainer script: a tiny model built in code (nothing downloaded), default arguments.

    torchrun --nproc-per-node 2 hf_trainer.py OUTDIR

Each process writes OUTDIR/rank{RANK}.json: the world size and process index the Trainer reported, the samples
it trained on, and its parameters before and after training.
"""

import json
import os
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments


class Points(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(32, 4, generator=generator)
        self.targets = self.inputs @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.25

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "x": self.inputs[index], "y": self.targets[index]}


class Regression(nn.Module):
    """Any module whose forward returns a dict with "loss" trains under Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seen: list[int] = []

    def forward(self, index: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict:
        self.seen += index.tolist()
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()]).tolist()


def main() -> None:
    outdir = sys.argv[1]
    torch.manual_seed(0)
    model = Regression()
    initial = flat(model)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(
            output_dir=scratch,
            per_device_train_batch_size=4,
            num_train_epochs=2,
            learning_rate=0.05,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Points())
        trainer.train()
    record = {
        "world_size": args.world_size,
        "rank": args.process_index,
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
