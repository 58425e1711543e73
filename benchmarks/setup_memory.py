"""Setup memory: how much each rank's resident memory grows while a model is built and set up, plainly or under
engine.init_module(), as a fraction of the model's fp32 bytes.

    python benchmarks/setup_memory.py [--nproc 1,2,3] [--strategies zero2,zero3] [--width 2048 --blocks 10]
                                      [--source random|checkpoint|smollm2]

The model is a stack of residual blocks (two Linear(width, 4*width) layers each: the units zero2/zero3 shard)
between an embedding and a head; the defaults make 402M parameters (1.5 GiB in fp32). --source checkpoint
first writes its weights to a safetensors file, and each case loads them with engine.load_pretrained (plainly:
into the whole model on every rank; under init_module: streamed by rank 0 into the shards). --source smollm2
finetunes SmolLM2-135M as `multigpu finetune --method full` builds it: from_pretrained on every rank (plain),
or from its config on the meta device and streamed from its safetensors (init_module).
Each case runs in fresh processes, after a small setup of the same strategy has paid the one-time costs
(process group, FSDP's imports), and measures from the resident memory before the build to the peak after
setup (Linux's VmHWM, reset first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import multigpu as mg
from multigpu.config.flags import parse_list
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


def build(engine: mg.Engine, meta: bool, source: str, width: int, blocks: int, checkpoint: str) -> nn.Module:
    if source == "smollm2":
        from multigpu.models import lm_models

        if not meta:
            return lm_models.load_model("smollm2", "full")
        with engine.init_module(meta=True):
            model = lm_models.load_model("smollm2", "full", skeleton=True)
        engine.load_pretrained(model, lm_models.model_dir("smollm2"))
        return model
    with engine.init_module() if meta else torch.no_grad():
        model = Net(width, blocks)
    if source == "checkpoint":
        engine.load_pretrained(model, checkpoint)
    return model


def build_and_setup(strategy: str, meta: bool, source: str, width: int, blocks: int, checkpoint: str) -> int:
    """The growth of this rank's resident memory from before the build to the peak after setup, in bytes."""
    engine = mg.Engine(strategy=strategy)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from what the process holds now
    before = memory("VmRSS")
    model = build(engine, meta, source, width, blocks, checkpoint)
    engine.setup(model, torch.optim.AdamW(model.parameters()))
    return memory("VmHWM") - before


def worker(strategy: str, meta: bool, source: str, width: int, blocks: int, out: str) -> None:
    build_and_setup(strategy, True, "random", 64, 2, "")  # one-time costs, paid before the measured setup
    growth = build_and_setup(strategy, meta, source, width, blocks, str(Path(out).parent / "model.safetensors"))
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(growth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", default="1,2,3", help="process counts (default 1,2,3)")
    parser.add_argument("--strategies", default="zero2,zero3", help="strategies (default zero2,zero3)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--source", choices=("random", "checkpoint", "smollm2"), default="random")
    parser.add_argument("--worker", nargs=3, metavar=("STRATEGY", "META", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        strategy, meta, out = args.worker
        worker(strategy, meta == "1", args.source, args.width, args.blocks, out)
        return
    with tempfile.TemporaryDirectory() as folder:
        if args.source == "smollm2":
            from multigpu.models import lm_models

            model_bytes = sum(p.numel() for p in lm_models.load_model("smollm2", "full").parameters()) * 4
        else:
            torch.manual_seed(0)
            net = Net(args.width, args.blocks)
            model_bytes = sum(p.numel() for p in net.parameters()) * 4
            if args.source == "checkpoint":
                save_file(net.state_dict(), str(Path(folder) / "model.safetensors"))
            del net
        print(f"model: {model_bytes / 4 / 1e6:.0f}M parameters, {model_bytes / 2**30:.2f} GiB in fp32; {args.source}")
        print("setup's growth of resident memory per rank, as a fraction of the model's fp32 bytes")
        print(f"{'strategy':<9} {'procs':>5}  {'plain build (rank 0 ...)':<28} {'init_module (rank 0 ...)':<28}")
        for strategy in parse_list(args.strategies, "--strategies", str):
            for nproc in parse_list(args.nproc, "--nproc", int):
                row = [case(args, strategy, nproc, meta, folder, model_bytes) for meta in ("0", "1")]
                print(f"{strategy:<9} {nproc:>5}  {row[0]:<28} {row[1]:<28}", flush=True)


def case(args: argparse.Namespace, strategy: str, nproc: int, meta: str, folder: str, model_bytes: int) -> str:
    out = Path(folder, f"{strategy}-{nproc}-{meta}")
    out.mkdir()
    shape = ["--width", str(args.width), "--blocks", str(args.blocks), "--source", args.source]
    code = launch(LaunchConfig(nproc=nproc), [__file__, *shape, "--worker", strategy, meta, str(out)])
    if code != 0:
        sys.exit(code)
    growth = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
    return " ".join(f"{g / model_bytes:.2f}" for g in growth)


if __name__ == "__main__":
    main()
