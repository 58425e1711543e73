"""The shape of PyTorch's DDP tutorial script (a trainer class holding the DDP model, snapshots from rank 0,
destroy_process_group() at the end of main()), on CPU with gloo: the script multigpu run must end every time.

    multigpu run -n 2 tests/scripts/ddp_tutorial.py EPOCHS SAVE_EVERY SNAPSHOT
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, save_every: int, snapshot: str) -> None:
        self.rank = int(os.environ["RANK"])
        self.data, self.save_every, self.snapshot = data, save_every, snapshot
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.epochs_run = 0
        if os.path.exists(snapshot):
            state = torch.load(snapshot)
            model.load_state_dict(state["model"])
            self.epochs_run = state["epochs_run"]
        self.model = DistributedDataParallel(model)

    def train(self, epochs: int) -> None:
        for epoch in range(self.epochs_run, epochs):
            self.data.sampler.set_epoch(epoch)
            for inputs, targets in self.data:
                self.optimizer.zero_grad()
                F.mse_loss(self.model(inputs), targets).backward()
                self.optimizer.step()
            if self.rank == 0 and epoch % self.save_every == 0:
                torch.save({"model": self.model.module.state_dict(), "epochs_run": epoch + 1}, self.snapshot)


def main(epochs: int, save_every: int, snapshot: str) -> None:
    init_process_group(backend="gloo")
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.rand(128, 20, generator=generator), torch.rand(128, 1, generator=generator))
    data = DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset))
    trainer = Trainer(torch.nn.Linear(20, 1), data, save_every, snapshot)
    trainer.train(epochs)
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
