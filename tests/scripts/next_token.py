"""A tiny next-token model trained with the Engine; `--bug` plants the mistakes `multigpu verify` must catch.

none        token-normalised loss over the global batch (loss summed, count= to backward); augmentation
            drawn from a generator seeded by the sample's index
dropout     dropout masks drawn from the process's random stream, which differs with the number of ranks
token-mean  the loss averaged over each rank's own tokens, then averaged over ranks
plain-loader  a torch DataLoader iterated whole on every rank (each process reads the same samples)

`--global-batch G` sizes the per-process batch as G // world_size, as scripts whose hyper-parameter is the global
batch do (correct; verify must compare it on the same global batch).
"""

import argparse
from typing import ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

import multigpu as mg

VOCAB, PAD = 32, -100


class Sequences(Dataset):
    """Sequences of 3 to 16 tokens: lengths differ, so per-rank token means differ from the global one."""

    def __init__(self, count: int = 96) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.items = [
            torch.randint(0, VOCAB, (int(torch.randint(3, 17, (1,), generator=generator)),), generator=generator)
            for _ in range(count)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        tokens = self.items[index].clone()
        # Augmentation keyed by the sample: the same on any number of processes.
        swap = torch.rand(len(tokens), generator=torch.Generator().manual_seed(index)) < 0.1
        tokens[swap] = (tokens[swap] + 1) % VOCAB
        return {"input": tokens[:-1], "target": tokens[1:]}


def collate(samples: list[dict]) -> dict:
    length = max(len(s["input"]) for s in samples)
    inputs = torch.zeros(len(samples), length, dtype=torch.long)
    targets = torch.full((len(samples), length), PAD)
    for row, s in enumerate(samples):
        inputs[row, : len(s["input"])] = s["input"]
        targets[row, : len(s["target"])] = s["target"]
    return {"input": inputs, "target": targets}


class NextToken(nn.Module):
    # Under tensor parallelism: hidden's outputs split, tanh on each slice, out sums the slices' contributions.
    tp_plan: ClassVar[dict[str, str]] = {"hidden": "colwise", "out": "rowwise"}
    # Under pipeline parallelism: the layers in the order each takes the previous one's output.
    pp_layers: ClassVar[list[str]] = ["embed", "hidden", "tanh", "dropout", "out"]

    def __init__(self, dropout: float, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.hidden = nn.Linear(width, width)
        self.tanh = nn.Tanh()
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(self.tanh(self.hidden(self.embed(tokens)))))


def token_sum(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss summed over the tokens, with their number: the engine divides by the global batch's count."""
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, reduction="sum")
    return loss, (target != PAD).sum()


def token_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """With --bug token-mean: the mean over this rank's tokens only."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=("none", "dropout", "token-mean", "plain-loader"), default="none")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--width", type=int, default=24, help="a multiple of 16 takes float8")
    args = parser.parse_args()

    engine = mg.Engine(strategy="ddp", seed=0)
    model = NextToken(dropout=0.2 if args.bug == "dropout" else 0.0, width=args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    batch_size = 4 if args.global_batch is None else args.global_batch // engine.world_size
    if args.bug == "plain-loader":
        loader = torch.utils.data.DataLoader(Sequences(), batch_size=batch_size, collate_fn=collate)
    else:
        loader = engine.dataloader(Sequences(), batch_size=batch_size, collate_fn=collate)
    for _ in range(args.epochs):
        for batch in loader:
            # One call for forward and backward, so that pipelines run it too.
            engine.forward_backward(
                model, batch["input"], batch["target"], token_mean if args.bug == "token-mean" else token_sum
            )
            engine.step(optimizer)


if __name__ == "__main__":
    main()
