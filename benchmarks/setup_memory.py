"""Setup memory: how much each rank's resident memory grows while a model is built and set up, plainly or under
engine.init_module(), as a fraction of the model's fp32 bytes.

    python benchmarks/setup_memory.py [--nproc 1,2,3] [--strategies zero2,zero3] [--width 2048 --blocks 10]

The model is a stack of residual blocks (two Linear(width, 4*width) layers each: the units zero2/zero3 shard)
between an embedding and a head; the defaults make 402M parameters (1.5 GiB in fp32). Each case runs in fresh
processes, after a small setup of the same strategy has paid the one-time costs (process group, FSDP's imports),
and measures from the resident memory before the build to the peak after setup (Linux's VmHWM, reset first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import multigpu as mg
from multigpu.core.config import parse_list
from multigpu.launch.launcher import LaunchConfig, launch


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int, vocab: int = 32000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def memory(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def build_and_setup(strategy: str, meta: bool, width: int, blocks: int) -> int:
    """The growth of this rank's resident memory from before the build to the peak after setup, in bytes."""
    engine = mg.Engine(strategy=strategy)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from what the process holds now
    before = memory("VmRSS")
    with engine.init_module() if meta else torch.no_grad():
        model = Net(width, blocks)
    engine.setup(model, torch.optim.AdamW(model.parameters()))
    return memory("VmHWM") - before


def worker(strategy: str, meta: bool, width: int, blocks: int, out: str) -> None:
    build_and_setup(strategy, True, 64, 2)  # one-time costs, paid before the measured setup
    growth = build_and_setup(strategy, meta, width, blocks)
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(growth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", default="1,2,3", help="process counts (default 1,2,3)")
    parser.add_argument("--strategies", default="zero2,zero3", help="strategies (default zero2,zero3)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--worker", nargs=3, metavar=("STRATEGY", "META", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        strategy, meta, out = args.worker
        worker(strategy, meta == "1", args.width, args.blocks, out)
        return
    model_bytes = sum(p.numel() for p in Net(args.width, args.blocks).parameters()) * 4
    print(f"model: {model_bytes / 4 / 1e6:.0f}M parameters, {model_bytes / 2**30:.2f} GiB in fp32")
    print("setup's growth of resident memory per rank, as a fraction of the model's fp32 bytes")
    print(f"{'strategy':<9} {'procs':>5}  {'plain build (per rank)':<28} {'init_module (per rank)':<28}")
    for strategy in parse_list(args.strategies, "--strategies", str):
        for nproc in parse_list(args.nproc, "--nproc", int):
            row = []
            for meta in ("0", "1"):
                with tempfile.TemporaryDirectory() as out:
                    shape = ["--width", str(args.width), "--blocks", str(args.blocks)]
                    code = launch(LaunchConfig(nproc=nproc), [__file__, *shape, "--worker", strategy, meta, out])
                    if code != 0:
                        sys.exit(code)
                    growth = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
                row.append(" ".join(f"{g / model_bytes:.2f}" for g in growth))
            print(f"{strategy:<9} {nproc:>5}  {row[0]:<28} {row[1]:<28}", flush=True)


if __name__ == "__main__":
    main()
