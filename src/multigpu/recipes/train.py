"""`multigpu train`: sensor-activity classification on any strategy and number of processes.

Warm-up then cosine learning rate, per-epoch metrics (JSONL and TensorBoard), sharded checkpoints that resume at
any world size, and a final model exported as safetensors plus a JSON that rebuilds it in plain torch.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multigpu.config.flags import Parser, add_config_arguments, config_from_args
from multigpu.config.layout import ParallelDims
from multigpu.config.settings import setting, shown, shown_group
from multigpu.core import atomic
from multigpu.core.errors import exit_on_usage_error, require
from multigpu.data import activity_data
from multigpu.engine.config import EngineConfig
from multigpu.engine.engine import Engine
from multigpu.engine.lr_schedule import SampleSchedule
from multigpu.launch.launcher import RAY, RECOVERY, LaunchConfig
from multigpu.models import activity_models
from multigpu.models.activity_models import MODES
from multigpu.recipes.common import (
    NOT_SHOWN_BY_RECIPES,
    NPROC_NOTE,
    NPROC_UNSET,
    RUN_RESULT,
    OptimizerChoice,
    ProgressBar,
    RecipeSettings,
    RunDirSettings,
    as_launched,
    finish_complete_run,
    peak_memory_mb,
    recipe_engine,
    record_run,
    resolve_resume,
    run_recipe,
    skipped_note,
    step_checkpoint,
    write_safetensors,
)
from multigpu.recipes.resume_changes import TRAIN, check_resume, follow_changes, following_hyperparameters
from multigpu.strategies import lays_out_along

LR_SCALING = ("none", "linear", "sqrt")
# The Engine's settings for a language model (its loss, Liger's kernels) or for parallelisms of sequences and
# layers (context, expert, sequence and pipeline parallelism), which the activity models take no part of: finetune
# shows them, train does not.
LANGUAGE_MODEL_ONLY = (
    *("loss", "liger", "pp_size", "cp_size", "ep_size", "cp_method", "sequence_parallel"),
    *("pp_schedule", "pp_stages_per_rank", "pp_microbatches", "pp_split"),
)


@dataclass
class TrainSettings(RecipeSettings, OptimizerChoice):
    """The launch's, the run directory's and the Engine's settings that train shows, each keeping its one definition
    (config/settings.py: shown); the strategy is --multi-gpu here."""

    nproc: int | None = shown(LaunchConfig, note=NPROC_NOTE, unset=NPROC_UNSET)
    gpu_ids: str | None = shown(LaunchConfig)
    share_gpus: bool = shown(LaunchConfig)
    _recovery = shown_group(LaunchConfig, *RECOVERY)
    _ray = shown_group(LaunchConfig, *RAY)
    save_dir: str = shown(RunDirSettings)
    resume: str = shown(RunDirSettings)
    save_every: int = shown(RunDirSettings)
    multi_gpu: str = shown(EngineConfig, "strategy")
    weight_decay: float = shown(EngineConfig, default=1e-4)
    log_every: int = shown(EngineConfig, default=100)
    _engine = shown_group(EngineConfig, omit=NOT_SHOWN_BY_RECIPES + LANGUAGE_MODEL_ONLY)


@dataclass
class TrainConfig(TrainSettings):
    mode: str = setting("conv", "model: MLP on the window or 1-D CNN", choices=MODES)
    data: str = setting("watch", "'watch' (seglearn's recordings) or a UCI HAR directory")
    epochs: int = setting(20, "passes over the training set")
    batch_size: int = setting(32, "windows per device per micro-batch")
    lr: float = setting(1e-3, "peak learning rate before --lr-scaling")
    lr_scaling: str = setting("none", "multiply lr by world x accumulation (or its root)", choices=LR_SCALING)
    warmup_epochs: float = setting(2.0, "linear warm-up, then cosine decay to zero")
    num_workers: int = setting(0, "data-loading processes per rank (the data is in memory)")
    keep_last: int = setting(3, "checkpoints to keep")
    async_save: bool = setting(False, "write checkpoints in the background")

    def check(self) -> None:
        require(
            (self.epochs >= 1, f"--epochs must be 1 or more (got {self.epochs})."),
            (self.batch_size >= 1, f"--batch-size must be 1 or more (got {self.batch_size}); it is per device."),
            (0 < self.lr < math.inf, f"--lr must be a positive finite number (got {self.lr})."),
            (0 <= self.warmup_epochs < math.inf, f"--warmup-epochs must be 0 or more (got {self.warmup_epochs})."),
            (self.num_workers >= 0, f"--num-workers must be 0 or more (got {self.num_workers})."),
            (self.keep_last >= 1, f"--keep-last must be 1 or more (got {self.keep_last})."),
            (
                self.mode == "flatten" or ((self.tp_size or 1) == 1 and not lays_out_along(self.multi_gpu, "tp")),
                "--mode conv has no layers tensor parallelism can split (convolutions); use --mode flatten under "
                "--multi-gpu tp or --tp-size.",
            ),
            (
                not lays_out_along(self.multi_gpu, "pp"),
                "multigpu train does not run under --multi-gpu pp yet (its evaluation gathers each sample's "
                "prediction from the whole model); use another strategy.",
            ),
        )


def scaled_lr(config: TrainConfig, world_size: int) -> float:
    factor = world_size * config.grad_accum_steps
    return config.lr * {"none": 1.0, "linear": factor, "sqrt": math.sqrt(factor)}[config.lr_scaling]


def evaluate(engine: Engine, model: nn.Module, loader) -> float:
    model.eval()
    with torch.no_grad():
        correct = torch.cat([model(x).argmax(dim=1) == y for x, y in loader])
    model.train()
    return engine.gather(correct).float().mean().item()


def export(engine: Engine, model: nn.Module, directory: Path, spec: list, data: activity_data.ActivityData) -> None:
    """model.safetensors + model_config.json in `directory`; gathers the full weights onto rank 0 (asked for)."""
    full = engine.full_state_dict(model)
    if engine.is_main_process:
        write_safetensors(full, directory / "model.safetensors", RUN_RESULT)
        config = {
            "layers": spec,
            "labels": data.labels,
            "input": {"channels": data.channels, "window": data.window, "mean": data.mean, "std": data.std},
        }
        text = json.dumps(config, indent=2)
        atomic.write_file(directory / "model_config.json", lambda partial: partial.write_text(text), RUN_RESULT)


def outputs(save_dir: Path) -> list[Path]:
    """What a train run writes as its result (export), the last of them last."""
    return [save_dir / "model.safetensors", save_dir / "model_config.json"]


@dataclass
class TrainRun:
    """What the training loop works on: the set-up model and optimizer, the loaders, the lr schedule and its plan
    (warm-up and total samples), and the state checkpoints hold."""

    engine: Engine
    config: TrainConfig
    data: activity_data.ActivityData
    spec: list
    parameters: int  # the model's, counted before setup (sharding may leave a rank's parameters empty)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: Any
    val_loader: Any
    scheduler: SampleSchedule
    plan: tuple[int, int]
    lr: float
    state: dict[str, Any]
    # This rank's loss sum and real samples in the running epoch, on the engine's device: adding a GPU loss into a
    # CPU tensor fails, and .item() would sync every step.
    epoch_loss: torch.Tensor | None = None

    @property
    def save_dir(self) -> Path:
        return Path(self.config.save_dir)

    @property
    def total_steps(self) -> int:
        return math.ceil(len(self.train_loader) / self.config.grad_accum_steps) * self.config.epochs

    def save(self) -> None:
        engine, state = self.engine, self.state
        state["epoch_loss"] = engine.reduce(self.epoch_loss, "sum").tolist()
        engine.save(step_checkpoint(self.save_dir, state["step"]), state, self.config.async_save, self.config.keep_last)
        if engine.is_main_process:
            record_run(self.config, "train", after_save=True)


def set_up(config: TrainConfig, engine: Engine) -> TrainRun:
    """The data, the model and optimizer set up for the engine's strategy, the loaders and the lr schedule."""
    data = activity_data.load(config.data)
    spec = activity_models.layer_spec(config.mode, data.channels, data.window, len(data.labels))
    model = activity_models.build(spec)
    model.tp_plan = activity_models.tp_plan(config.mode)
    parameters = sum(p.numel() for p in model.parameters())
    lr = scaled_lr(config, engine.data_parallel_size)
    if config.lr_scaling != "none":
        engine.print(f"lr {config.lr:g} x {lr / config.lr:g} ({config.lr_scaling} scaling) = {lr:g}")
    model, optimizer = engine.setup(model, engine.optimizer(model, lr))
    train_loader = engine.dataloader(
        data.train, batch_size=config.batch_size, shuffle=True, num_workers=config.num_workers
    )
    val_loader = engine.dataloader(data.validation, batch_size=256, shuffle=False)
    epoch_samples = len(data.train)
    plan = (round(config.warmup_epochs * epoch_samples), config.epochs * epoch_samples)
    scheduler = SampleSchedule(optimizer, train_loader, *plan)
    # The loader before the scheduler: the schedule's lr on resume follows from the loader's restored position.
    # "epoch_loss": the running epoch's loss sum and sample count over all ranks, so a resume mid-epoch still
    # reports the loss of the whole epoch.
    state = {
        "model": model,
        "optimizer": optimizer,
        "loader": train_loader,
        "scheduler": scheduler,
        "step": 0,
        "epoch_loss": [0.0, 0.0],
    }
    engine.heal_with(state)  # under fault tolerance, what a replica group that rejoins copies from a live one
    return TrainRun(
        engine, config, data, spec, parameters, model, optimizer, train_loader, val_loader, scheduler, plan, lr, state
    )


def resume(run: TrainRun, resume_from: Path, record: dict[str, Any]) -> bool:
    """Loads the checkpoint `resume_from` into the run; whether its training is complete already (its result then
    stays as it is, or is written now)."""
    engine, scheduler, loader = run.engine, run.scheduler, run.train_loader
    with following_hyperparameters(run.optimizer):
        engine.load(resume_from, run.state)
    engine.print(
        f"resumed from {resume_from} at step {run.state['step']} (epoch {loader.epoch + 1}, "
        f"{loader.position} of {len(run.data.train)} samples done)"
    )
    for line in follow_changes(scheduler, run.config, record, TRAIN, run.plan, run.lr):
        engine.print(line)
    if not scheduler.done:
        return False
    finish = functools.partial(export, engine, run.model, run.save_dir, run.spec, run.data)
    finish_complete_run(engine, run.config, run.state["step"], "--epochs", outputs(run.save_dir), finish)
    return True


def describe(run: TrainRun) -> str:
    data, config, engine = run.data, run.config, run.engine
    return (
        f"{data.source}: {len(data.train)} training / {len(data.validation)} validation windows of "
        f"{data.channels}x{data.window}, {len(data.labels)} classes; {config.mode} model, "
        f"{run.parameters:,} parameters; "
        f"strategy {engine.strategy}, {engine.world_size} process(es)"
    )


def train(config: TrainConfig) -> dict:
    engine = recipe_engine(config)
    engine.log_config(asdict(config))
    resume_from = resolve_resume(config, engine.print)
    record = check_resume(config, resume_from, TRAIN)
    run = set_up(config, engine)
    if resume_from is not None and resume(run, resume_from, record):  # nothing to train
        return {"history": [], "steps": run.state["step"], "world_size": engine.world_size}
    if engine.is_main_process:  # once the save dir and the checkpoint resumed from are known good
        record_run(config, "train")
    engine.print(describe(run))
    progress = ProgressBar(engine, run.total_steps)
    history = []
    while run.train_loader.epoch < config.epochs:
        history.append(train_epoch(run, progress))
        run.save()
    engine.wait_for_checkpoint()
    progress.close()
    export(engine, run.model, run.save_dir, run.spec, run.data)
    if engine.is_main_process and history:
        print_summary(history, run.save_dir)
    return {"history": history, "steps": run.state["step"], "world_size": engine.world_size}


def train_epoch(run: TrainRun, progress: ProgressBar) -> dict[str, Any]:
    """One epoch (the rest of it, on resume) and its history entry, logged and printed."""
    engine, config, state, loader = run.engine, run.config, run.state, run.train_loader
    epoch, start, samples = loader.epoch, time.perf_counter(), 0
    # The epoch's loss carried over from the checkpoint on rank 0 only (it holds the sums of all ranks).
    carried = state["epoch_loss"] if engine.is_main_process else [0.0, 0.0]
    run.epoch_loss = torch.tensor(carried, dtype=torch.float64, device=engine.device)
    state["epoch_loss"] = [0.0, 0.0]
    for x, y in loader:
        real = loader.yielded[-1].real
        loss = engine.forward_backward(run.model, x, y, nn.functional.cross_entropy)
        run.epoch_loss += torch.stack([loss.double() * real, run.epoch_loss.new_tensor(float(real))])
        samples += loader.yielded[-1].global_size
        update_lr = run.optimizer.param_groups[0]["lr"]  # of this update: the schedule gives the next one on its step
        if engine.step(run.optimizer, run.scheduler):
            state["step"] += 1
            progress.advance(state["step"], f"epoch {epoch + 1} loss {loss.item():.3f}")
            if config.save_every and state["step"] % config.save_every == 0:
                run.save()
    totals = engine.reduce(run.epoch_loss, "sum")
    run.epoch_loss = torch.zeros_like(run.epoch_loss)  # the epoch is over: its checkpoint carries nothing on
    seconds = time.perf_counter() - start
    record = {
        "epoch": epoch + 1,
        "train_loss": (totals[0] / totals[1]).item(),
        "val_accuracy": evaluate(engine, run.model, run.val_loader),
        "samples_per_s": samples / seconds,
        "lr": update_lr,  # the epoch's last update's: at the epoch's end in the data, at any world size
        "skipped_steps": engine.skipped_steps,
        "peak_memory_mb": peak_memory_mb(engine, ndigits=1),
    }
    engine.log(state["step"], {k: v for k, v in record.items() if k != "peak_memory_mb"})
    engine.print(
        f"epoch {record['epoch']}/{config.epochs}  loss {record['train_loss']:.4f}  "
        f"val acc {record['val_accuracy']:.3f}  {record['samples_per_s']:.0f} samples/s  lr {record['lr']:.2e}  "
        f"peak MB per rank {record['peak_memory_mb']}" + skipped_note(engine)
    )
    return record


def print_summary(history: list[dict], save_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="training summary")
    for column in ("epoch", "train loss", "val accuracy", "samples/s", "lr"):
        table.add_column(column, justify="right")
    for r in history:
        table.add_row(
            str(r["epoch"]),
            f"{r['train_loss']:.4f}",
            f"{r['val_accuracy']:.3f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['lr']:.2e}",
        )
    console = Console()
    console.print(table)
    best = max(history, key=lambda r: r["val_accuracy"])
    console.print(
        f"final val accuracy {history[-1]['val_accuracy']:.3f} (best {best['val_accuracy']:.3f} at epoch "
        f"{best['epoch']}); model: {save_dir / 'model.safetensors'} + model_config.json"
    )


def check(config: TrainConfig, layout: ParallelDims) -> None:
    """What `multigpu train` refuses before any process starts: data it cannot read, a --resume or --save-dir
    that cannot work, a change the resume cannot take (resume_changes; any `layout` trains its small models)."""
    activity_data.check(config.data)
    check_resume(config, resolve_resume(config), TRAIN)


def run(config: TrainConfig) -> int:
    """What `multigpu train` does: train here (1 process, or already under a launcher) or launch --nproc."""
    return run_recipe(config, "multigpu.recipes.train", train, check)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m multigpu.recipes.train", description=__doc__)
    add_config_arguments(parser, TrainConfig)
    train(as_launched(config_from_args(TrainConfig, parser.parse_args(argv))))


if __name__ == "__main__":
    sys.exit(exit_on_usage_error(main))
