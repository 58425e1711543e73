"""What the recipes share: checking a run before any process starts and launching it (the CLI's train, finetune
and demo verbs), and the training-loop pieces that train and finetune both use."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from multigpu.core.config import config_to_argv
from multigpu.core.errors import UsageError
from multigpu.engine import checkpoint, start
from multigpu.engine.config import EngineConfig
from multigpu.engine.engine import Engine
from multigpu.engine.monitor import peak_memory_bytes
from multigpu.launch.launcher import LaunchConfig, launch, select_gpus


class RunDir(Protocol):
    save_dir: str
    resume: str


# -- before any process starts ---------------------------------------------------------------------------------
def run_recipe(config: Any, module: str, run: Callable[[Any], Any], check: Callable[[Any], None]) -> int:
    """Runs a recipe in this process (under a launcher already, or 1 process), or launches --nproc of `module`.

    `config` is a recipe's (TrainConfig, FinetuneConfig); `check(config)` refuses its bad input before anything
    starts, as the GPUs named and the Engine's settings are refused here, so that a mistake is one line rather
    than one per worker.
    """
    if "RANK" in os.environ:  # already under torchrun / multigpu run / accelerate launch
        run(as_launched(config))
        return 0
    # dp drives every GPU named from one process; the others run a process per GPU.
    named_gpus = [part for part in (config.gpu_ids or "").split(",") if part.strip()]
    nproc = config.nproc or (1 if config.multi_gpu == "dp" else len(named_gpus)) or 1
    restarts = getattr(config, "max_restarts", 0)
    launch_config = LaunchConfig(nproc=nproc, gpu_ids=config.gpu_ids, max_restarts=restarts)
    if config.gpu_ids is not None:  # GPUs that are not there, before the strategies count them
        select_gpus(launch_config, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    start.check(EngineConfig(**engine_settings(config)), nproc)
    check(config)
    if nproc == 1 and config.gpu_ids is None and restarts == 0:
        run(config)
        return 0
    # torchrun would take --nproc and --max-restarts for its own; the workers read them from it (as_launched).
    argv = config_to_argv(config, skip=("nproc", "max_restarts"))
    return launch(launch_config, [module, *argv], module=True)


def as_launched(config: Any) -> Any:
    """A launched worker's `config` with the launch it runs in (torchrun's variables): the processes per node and
    the restarts allowed, so that the settings it records (config.yaml) launch the same run again."""
    if "RANK" not in os.environ:
        return config
    launch = {"nproc": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    if hasattr(config, "max_restarts"):
        launch["max_restarts"] = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    return replace(config, **launch)


def engine_settings(config: Any) -> dict[str, Any]:
    """The Engine settings of a recipe's config (TrainConfig, FinetuneConfig): every EngineConfig field it has,
    with --multi-gpu as the strategy and --save-dir for the logs. The check before launching (run_recipe) and the
    workers' Engine (recipe_engine) both take them from here, so EngineConfig refuses a bad one before any worker
    starts."""
    names = [field.name for field in fields(EngineConfig) if hasattr(config, field.name)]
    return {name: getattr(config, name) for name in names} | {"strategy": config.multi_gpu, "log_dir": config.save_dir}


def resolve_resume(config: RunDir, say: Callable[[str], None] = print) -> Path | None:
    """The checkpoint to start from, or None, once --save-dir is known to be writable; refuses to write over
    another run's checkpoints. With 'auto', the newest one that is whole (a damaged one is passed over and named
    through `say`)."""
    directory = Path(config.save_dir) / "checkpoints"
    if config.resume == "auto":
        found = checkpoint.newest_usable(directory, say)
    elif config.resume == "none":
        if checkpoint.list_checkpoints(directory):
            raise UsageError(
                f"{directory} already holds checkpoints of another run; pass --resume auto to continue it, "
                "or choose another --save-dir."
            )
        found = None
    else:
        found = Path(config.resume)
        checkpoint.check_checkpoint(found)
    checkpoint.check_writable(Path(config.save_dir), "--save-dir")
    return found


# -- in the training loop --------------------------------------------------------------------------------------
def recipe_engine(config: Any) -> Engine:
    """The Engine of a recipe's config (TrainConfig, FinetuneConfig), logging into its --save-dir."""
    return Engine(**engine_settings(config))


def step_checkpoint(save_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of optimizer step `step` goes: the names sort in step order (resolve_resume's 'auto')."""
    return Path(save_dir) / "checkpoints" / f"step-{step:08d}"


def skipped_note(engine: Engine) -> str:
    """What fp16 loss scaling skipped so far, for a progress line; empty while nothing was skipped."""
    if not engine.skipped_steps:
        return ""
    return f"  ({engine.skipped_steps} step(s) skipped for inf/nan gradients; the lr schedule waited)"


def per_rank(engine: Engine, value: float) -> list[float]:
    """Every rank's `value`, in rank order, on every rank."""
    slots = torch.zeros(engine.world_size, dtype=torch.float64)
    slots[engine.rank] = value
    return engine.reduce(slots, op="sum").tolist()


def peak_memory_mb(engine: Engine, ndigits: int | None = None) -> list[float]:
    """Every rank's peak memory in MiB, rounded to `ndigits` (None: whole numbers)."""
    return [round(b / 2**20, ndigits) for b in per_rank(engine, peak_memory_bytes(engine.device))]


class ProgressBar:
    """A progress bar on a terminal, plain lines otherwise; rank 0 only."""

    def __init__(self, engine: Engine, total: int) -> None:
        self.bar = None
        if engine.is_main_process and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
            )
            self.bar.start()
            self.task = self.bar.add_task("training", total=total, status="")

    def advance(self, step: int, status: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, status=status)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# -- after training --------------------------------------------------------------------------------------------
def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`tensors` as one safetensors file (which needs contiguous tensors), its directory made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))


def export_checkpoint(directory: Path, out: Path, key: str = "model") -> None:
    """`multigpu export`: every shard of a checkpoint's model, read in this process, written to `out`."""
    tensors = checkpoint.full_model_state(directory, key=key)
    write_safetensors(tensors, out)
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()):,} values) to {out}")
