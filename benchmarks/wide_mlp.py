"""An Engine script whose gradients are big enough for communication to matter on CPU (used by the benchmarks).

multigpu bench benchmarks/wide_mlp.py --nproc 1,2,3 --strategies ddp,zero2
"""

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    engine = mg.Engine(strategy="ddp")
    blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)]
    model = nn.Sequential(*blocks, nn.Linear(args.width, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = engine.setup(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8192, args.width, generator=generator), torch.randint(0, 10, (8192,)))
    loader = engine.dataloader(data, batch_size=args.batch_size)
    while True:  # the harness stops it after bench's steps
        for x, y in loader:
            with engine.accumulate(model):
                engine.backward(nn.functional.cross_entropy(model(x), y))
            engine.step(optimizer)


if __name__ == "__main__":
    main()
