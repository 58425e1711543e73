"""A small built-in example: classify points of a noisy spiral with an MLP, on any strategy and process count.

Run it with `multigpu demo --nproc 2`; it reads like the loop a user would write with the Engine.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from multigpu.config.flags import Parser, add_config_arguments, config_from_args
from multigpu.config.layout import ParallelDims
from multigpu.config.settings import Settings, setting, shown, shown_group
from multigpu.core.errors import UsageError, exit_on_usage_error, require
from multigpu.engine.config import EngineConfig
from multigpu.engine.engine import Engine
from multigpu.launch.launcher import RAY, RECOVERY, LaunchConfig
from multigpu.recipes.common import run_recipe


@dataclass
class DemoConfig(Settings):
    epochs: int = setting(8, "passes over the training set")
    batch_size: int = setting(64, "samples per device per micro-batch")
    lr: float = setting(3e-3, "learning rate")
    samples: int = setting(4096, "size of the generated training set")

    def check(self) -> None:
        require(
            (self.epochs >= 1, f"--epochs must be 1 or more (got {self.epochs})."),
            (self.batch_size >= 1, f"--batch-size must be 1 or more (got {self.batch_size}); it is per device."),
            (0 < self.lr < math.inf, f"--lr must be a positive finite number (got {self.lr})."),
            (self.samples >= 1, f"--samples must be 1 or more (got {self.samples})."),
        )


def spiral(samples: int, classes: int = 3, seed: int = 1234) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    label = torch.randint(0, classes, (samples,), generator=generator)
    radius = torch.rand(samples, generator=generator)
    angle = radius * 4.0 + label * (2 * math.pi / classes) + 0.2 * torch.randn(samples, generator=generator)
    points = torch.stack([radius * torch.sin(angle), radius * torch.cos(angle)], dim=1)
    return TensorDataset(points, label)


def train(engine: Engine, config: DemoConfig) -> tuple[float, float]:
    """Trains; returns the last epoch's training loss and validation accuracy (over the whole validation set)."""
    model = nn.Sequential(nn.Linear(2, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 3))
    # Under tensor parallelism: the first layer's outputs split, the GELU works on each slice, the second layer
    # sums the slices' contributions (strategies/tp.py).
    model.tp_plan = {"0": "colwise", "2": "rowwise"}
    model, optimizer = engine.setup(model, engine.optimizer(model, config.lr))
    engine.print(f"strategy {engine.strategy}, precision {engine.precision.name}, {engine.world_size} process(es)")
    train_loader = engine.dataloader(spiral(config.samples), batch_size=config.batch_size, shuffle=True)
    val_loader = engine.dataloader(spiral(1024, seed=99), batch_size=256, shuffle=False)
    loss_fn = nn.CrossEntropyLoss()
    train_loss = accuracy = 0.0
    while train_loader.epoch < config.epochs:  # the loader's count: a replica group that heals carries it on
        epoch, start, total, batches = train_loader.epoch, time.perf_counter(), 0.0, 0
        model.train()
        for points, label in train_loader:
            loss = engine.forward_backward(model, points, label, loss_fn)
            engine.step(optimizer)
            total, batches = total + loss.item(), batches + 1
        model.eval()
        right, seen = 0.0, 0.0
        for points, label in val_loader:
            label = label.clone()
            label[val_loader.yielded[-1].real :] = -1  # rows that pad a short last batch count nothing
            batch_right, batch_total = engine.forward_loss(model, points, label, hits)
            right, seen = right + float(batch_right), seen + float(batch_total)
        # Every rank of one replica (tp, pp) holds its replica's counts, so their ratio is the accuracy.
        accuracy = engine.reduce(right, "sum") / max(engine.reduce(seen, "sum"), 1.0)
        train_loss = engine.reduce(total / max(batches, 1))
        engine.print(
            f"epoch {epoch + 1}/{config.epochs}  train loss {train_loss:.4f}  val accuracy {accuracy:.3f} "
            f"({len(val_loader.dataset)} samples)  {time.perf_counter() - start:.2f}s"
        )
    return train_loss, accuracy


def hits(logits: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(right predictions, samples) of a batch, or of a pipeline's micro-batch of it; label -1 marks padding."""
    real = label >= 0
    return ((logits.argmax(dim=1) == label) & real).sum().float(), real.sum()


@dataclass
class DemoLaunch(Settings):
    """The launch's settings the demo verb shows beside --nproc: restarts and fault-tolerant replica groups."""

    _recovery = shown_group(LaunchConfig, *RECOVERY)
    _ray = shown_group(LaunchConfig, *RAY)


@dataclass
class DemoRun(DemoConfig, EngineConfig, DemoLaunch):
    """The demo's run as one recipe config for run_recipe: its settings and the Engine's (inherited, flag for flag:
    the CLI's demo verb takes them all), and the processes."""

    nproc: int | None = shown(LaunchConfig)
    gpu_ids: str | None = shown(LaunchConfig)
    share_gpus: bool = shown(LaunchConfig)

    def values_for(self, source: type) -> dict[str, Any]:
        if source in (DemoConfig, EngineConfig):  # inherited whole, so held under their own names
            return {field.name: getattr(self, field.name) for field in fields(source)}
        return super().values_for(source)

    def check(self) -> None:
        """What the demo's run refuses beyond its settings' own checks: a language model's loss settings."""
        if self.loss != "plain" or self.liger:
            raise UsageError(
                "loss and liger change a language model's output head and cross-entropy, and the demo trains a small "
                "classifier; drop them (multigpu finetune takes them)."
            )


def check(config: DemoRun, layout: ParallelDims) -> None:
    """What the demo refuses once the Engine's settings passed (they hold for any model): a split of sequences."""
    if (config.cp_size or 1) > 1:
        raise UsageError(
            "cp_size splits each sequence of a batch, and the demo trains on points, which have none; drop "
            "--cp-size (multigpu finetune splits its sequences)."
        )


def train_here(config: DemoRun) -> None:
    """The demo in this process, from run_recipe (1 process, or already under a launcher)."""
    run_demo(DemoConfig(**config.values_for(DemoConfig)), EngineConfig(**config.values_for(EngineConfig)))


def run_demo(config: DemoConfig, engine_config: EngineConfig) -> None:
    """The demo's Engine, then its training: what each process runs."""
    engine = Engine(**vars(engine_config))
    engine.log_config(asdict(config))
    train(engine, config)


def run(config: DemoRun) -> int:
    """What `multigpu demo` does: refuse what the Engine would refuse, then train here (1 process, or already under
    a launcher) or launch --nproc processes of this."""
    return run_recipe(config, "multigpu.recipes.demo", train_here, check)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m multigpu.recipes.demo", description=__doc__)
    add_config_arguments(parser, DemoConfig)
    add_config_arguments(parser, EngineConfig)
    args = parser.parse_args(argv)
    run_demo(config_from_args(DemoConfig, args), config_from_args(EngineConfig, args))


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
