"""What the recipes share: checking a run before any process starts and launching it (the CLI's train, finetune
and demo verbs), and the training-loop pieces that train and finetune both use."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml
from safetensors.torch import save_file

from multigpu import checkpoint
from multigpu.checkpoint import run_lock
from multigpu.config.config_writer import RUN_CONFIG, save_run_config
from multigpu.config.flags import config_to_argv
from multigpu.config.layout import ParallelDims
from multigpu.config.optimizer import OptimizerSettings
from multigpu.config.settings import Settings, setting, shown_group
from multigpu.core import atomic
from multigpu.core.errors import UsageError, require
from multigpu.core.launcher_notes import LAST_CHECKPOINT, LAUNCHER_DIR, attempt, launched, launcher_note
from multigpu.core.replica_env import ReplicaGroup
from multigpu.engine import start
from multigpu.engine.config import EngineConfig
from multigpu.engine.engine import Engine
from multigpu.launch.launcher import RAY, RECOVERY, LaunchConfig, launch, select_gpus
from multigpu.launch.replica_groups import STARTED_HERE
from multigpu.observers.monitor import peak_memory_bytes
from multigpu.strategies import drives_gpus_in_process
from multigpu.transforms.pretrained import give_usual_mode


class RunDir(Protocol):
    save_dir: str
    resume: str


@dataclass
class RunDirSettings(Settings):
    """Where a recipe's run keeps what it writes, and where it starts from."""

    save_dir: str = setting("checkpoints/run", "the run's directory: checkpoints, metrics, its config.yaml and outputs")
    resume: str = setting("auto", "'auto' (newest checkpoint in --save-dir), 'none' or a PATH")
    save_every: int = setting(
        0,
        "also checkpoint every N optimizer steps (0: only where the recipe does anyway: train each epoch, finetune "
        "at the end)",
    )

    def check(self) -> None:
        require((self.save_every >= 0, f"--save-every must be 0 or more (got {self.save_every})."))


class RecipeSettings(Settings):
    """A recipe's settings, shown from the launch's, the run directory's and the Engine's (`shown`, each keeping its
    one definition) beside its own: the Engine's log_dir is the run's save_dir (its metrics go with its
    checkpoints)."""

    save_dir: str  # declared by each recipe's settings, shown from RunDirSettings

    def values_for(self, source: type) -> dict[str, Any]:
        values = super().values_for(source)
        return values | {"log_dir": self.save_dir} if source is EngineConfig else values


@dataclass
class OptimizerChoice(Settings):
    """The Engine's optimizer settings, as train and finetune show them (each keeping its one definition)."""

    _optimizer = shown_group(EngineConfig, OptimizerSettings)


# The Engine's settings that neither recipe shows: global_batch_size, cpu_offload, find_unused_parameters,
# sync_batchnorm and backend keep the Engine's defaults; the log_dir is the run's --save-dir (RecipeSettings).
NOT_SHOWN_BY_RECIPES = (
    "global_batch_size",
    "cpu_offload",
    "find_unused_parameters",
    "sync_batchnorm",
    "backend",
    "log_dir",
)


#: What a recipe's --nproc adds to the launch's help, and what its unset value means.
NPROC_NOTE, NPROC_UNSET = ", launched when not under a launcher", "1, or one per --gpu-ids"


# -- before any process starts ---------------------------------------------------------------------------------
def run_recipe(config: Any, module: str, run: Callable[[Any], Any], check: Callable[[Any, ParallelDims], None]) -> int:
    """Runs a recipe in this process (under a launcher already, or 1 process), or launches --nproc of `module`.

    `config` is a recipe's (TrainConfig, FinetuneConfig, the demo's DemoRun); `check(config, layout)` refuses its
    bad input before anything starts (`layout`: the degrees the workers would resolve), as the GPUs named and the
    Engine's settings are refused here, so that a mistake is one line rather than one per worker.
    """
    if "RANK" in os.environ:  # already under torchrun / multigpu run / accelerate launch
        run(as_launched(config))
        return 0
    settings = engine_settings(config)
    # dp drives every GPU named from one process; the others run a process per GPU.
    named_gpus = [part for part in (config.gpu_ids or "").split(",") if part.strip()]
    nproc = config.nproc or (1 if drives_gpus_in_process(settings["strategy"]) else len(named_gpus)) or 1
    launch_config = LaunchConfig(**config.values_for(LaunchConfig) | {"nproc": nproc})
    restarts, groups = launch_config.max_restarts, launch_config.replica_groups
    if groups > 1 and not config.fault_tolerance:
        raise UsageError(
            f"--replica-groups {groups} trains the groups under torchft's fault tolerance; add --fault-tolerance."
        )
    if config.fault_tolerance and groups == 1 and launch_config.replica_id is None:
        raise UsageError(start.NEEDS_REPLICA_GROUPS)
    if config.gpu_ids is not None or config.share_gpus:  # GPUs that are not there, before the strategies count them
        select_gpus(launch_config, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    layout = start.check(EngineConfig(**settings), nproc)
    save_dir = getattr(config, "save_dir", None)  # None: a run that writes nothing to keep (the demo)
    with contextlib.ExitStack() as held:
        # One run per --save-dir, held by this process for the run's life (its workers inherit it). Taken before
        # `check` where the directory exists, since check reads its checkpoints (and moves damaged ones aside);
        # a new directory is made only once the run is known good.
        if save_dir is not None and os.access(save_dir, os.W_OK) and Path(save_dir).is_dir():
            held.enter_context(run_lock.holding(save_dir))
        check(config, layout)
        if save_dir is not None:
            held.enter_context(run_lock.holding(save_dir))  # nothing more where held already
        # A replica group, and a run on Ray, are always launched.
        in_process = groups == 1 and launch_config.replica_id is None and launch_config.ray is None
        if nproc == 1 and config.gpu_ids is None and restarts == 0 and in_process:
            run(config)
            return 0
        # torchrun would take --nproc and --max-restarts for its own, and the replica groups are the launch's; the
        # workers read them (and whether they share GPUs) from its variables (as_launched).
        argv = config_to_argv(config, skip=LAUNCH_ONLY)
        return launch(launch_config, [module, *argv], module=True)


#: A recipe's launch settings that its launched workers are not given as flags (as_launched reads them back).
LAUNCH_ONLY = ("nproc", "share_gpus", *RECOVERY, *RAY)


def as_launched(config: Any) -> Any:
    """A launched worker's `config` with the launch it runs in (torchrun's variables): the processes per node and
    the restarts allowed, so that the settings it records (config.yaml) launch the same run again."""
    if "RANK" not in os.environ:
        return config
    launch: dict[str, Any] = {"nproc": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    if hasattr(config, "share_gpus"):
        launch["share_gpus"] = torch.cuda.is_available() and launch["nproc"] > torch.cuda.device_count()
    if hasattr(config, "max_restarts"):
        launch["max_restarts"] = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    group = ReplicaGroup.from_environ()
    if hasattr(config, "replica_groups") and group is not None:
        # Groups started together on one machine are started so again; a cluster's group rejoins its lighthouse.
        here = STARTED_HERE in os.environ
        launch |= {"replica_groups": group.groups, "min_replicas": group.min_replicas}
        launch |= {"replica_id": None if here else group.group_id}
        launch |= {"lighthouse": None if here else group.lighthouse.removeprefix("http://")}
    return replace(config, **launch)


def engine_settings(config: Any) -> dict[str, Any]:
    """The Engine settings of a recipe's config (TrainConfig, FinetuneConfig), with --save-dir for the logs. The
    check before launching (run_recipe) and the workers' Engine (recipe_engine) both take them from here."""
    return config.values_for(EngineConfig)


def resolve_resume(config: RunDir, say: Callable[[str], None] = print) -> Path | None:
    """The checkpoint to start from, or None, once --save-dir is known to be writable; refuses to write over
    another run's checkpoints. With 'auto', the newest one that is whole (a damaged one is passed over and named
    through `say`). A restart (--max-restarts) resumes from this run's newest complete checkpoint, whatever the
    first start was told (see restart_checkpoint)."""
    directory = Path(config.save_dir) / "checkpoints"
    found = restart_checkpoint(directory, say) if restarted() else None
    if found is None:
        # A restart before the run's first checkpoint: the start's --resume again, but 'none' would now find the
        # checkpoints it made sure were absent (damaged ones of this run, at most).
        resume = "auto" if restarted() and config.resume == "none" else config.resume
        found = start_checkpoint(directory, resume, say)
    checkpoint.check_writable(Path(config.save_dir), "--save-dir")
    checkpoint.check_shared(Path(config.save_dir), "--save-dir")  # workers: before the first step, not at a save
    return found


def start_checkpoint(directory: Path, resume: str, say: Callable[[str], None]) -> Path | None:
    """What --resume `resume` starts from: 'auto' the newest whole checkpoint, 'none' nothing (refusing a directory
    that holds another run's), else the checkpoint at that path."""
    if resume == "auto":
        return checkpoint.newest_usable(directory, say)
    if resume == "none":
        if checkpoint.list_checkpoints(directory):
            raise UsageError(
                f"{directory} already holds checkpoints of another run; pass --resume auto to continue it, "
                "or choose another --save-dir."
            )
        return None
    found = Path(resume)
    checkpoint.check_checkpoint(found)
    return found


def restarted() -> bool:
    """Whether this process is a restart of the run's workers (torchrun's --max-restarts)."""
    return attempt() > 0


def restart_checkpoint(directory: Path, say: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint this run committed before the restart, or None if it committed none.

    Under `multigpu run` the launcher keeps a note of the last checkpoint committed, so a run started from
    --resume PATH goes on from its own newer checkpoints rather than back to PATH (which keep_last may have pruned
    meanwhile). Under another launcher there is no note: the newest complete checkpoint in --save-dir is taken."""
    if not launched():
        return checkpoint.newest_usable(directory, say)
    noted = launcher_note(os.environ[LAUNCHER_DIR], LAST_CHECKPOINT)
    return Path(noted) if noted is not None and checkpoint.damage(Path(noted)) is None else None


def run_record(resumed_from: Path) -> dict[str, Any]:
    """The settings of the run that wrote the checkpoint `resumed_from` (its save dir's config.yaml); empty when
    that run kept none (an older version) or the file is not ours to read."""
    try:
        record = yaml.safe_load((resumed_from.parent.parent / RUN_CONFIG).read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return record if isinstance(record, dict) else {}


def finish_complete_run(
    engine: Engine, config: Any, step: int, lengthen: str, outputs: list[Path], write: Callable[[], Any]
) -> None:
    """What a resumed run that has nothing left to train does: says so (complete_line), or, where its result was
    not written whole (a full disk as it was written), calls `write` to write it from the checkpoint just loaded,
    without training again. Rank 0's view decides, for every rank (`write` gathers the weights collectively)."""
    missing = missing_outputs(outputs) if engine.is_main_process else []
    if not engine.reduce(float(len(missing)), op="sum"):
        engine.print(complete_line(config, step, lengthen))
        return
    engine.print(
        f"The run in {config.save_dir} finished training at step {step} but its result was not written whole "
        f"({', '.join(path.name for path in missing)}); writing it from the last checkpoint, without training."
    )
    write()
    engine.print(f"wrote {', '.join(str(path) for path in outputs)}")


def missing_outputs(outputs: list[Path]) -> list[Path]:
    """Those of a run's `outputs` (files, or model directories) not there whole: absent, or a directory without its
    weights (as a run that failed while writing it left one, before results were written atomically)."""
    return [path for path in outputs if not (path.is_file() or (path.is_dir() and any(path.glob("*.safetensors"))))]


def complete_line(config: Any, step: int, lengthen: str) -> str:
    """What a resumed run that has nothing left to train says instead of training (and rewriting its outputs)."""
    return (
        f"The run in {config.save_dir} is complete at step {step}; nothing to train: pass a larger {lengthen} to "
        "continue it, or another --save-dir for a new run."
    )


def record_run(config: Any, verb: str, after_save: bool = False) -> None:
    """<save_dir>/config.yaml: the settings the run runs with, so that `--config` of it continues the run. Its
    resume is 'auto' once the save dir holds a checkpoint (or when the run started from none); until then a run
    started from --resume PATH keeps PATH. `after_save`: called after a save, when only that can change it."""
    if after_save and config.resume in ("auto", "none"):
        return
    held = checkpoint.list_checkpoints(Path(config.save_dir) / "checkpoints")
    resume = "auto" if config.resume == "none" or held else config.resume
    save_run_config(replace(config, resume=resume), config.save_dir, verb)


def check_new_output(path: Path, flag: str, example: str | None = None) -> None:
    """Refuses, before any work, an output that would be lost at the end: `path` exists already (nothing here
    overwrites a user's file; for a file, `example` names a fresh one where `path` is a directory), or its
    directory cannot be made or written."""
    if path.is_dir() and example is not None:
        raise UsageError(f"{flag} {path} is a directory; pass a name that does not exist yet, such as {example}.")
    if path.exists() or path.is_symlink():
        raise UsageError(f"{flag} {path} exists already; remove it, or choose another {flag}.")
    checkpoint.check_writable(path.parent, flag, named=path)


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
        self.bar, self.engine = None, engine
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
            if self.engine.batch_speeds is not None:  # batch_shares auto: the split it moved to so far
                status += "  shares " + ":".join(f"{share:.2f}" for share in self.engine.batch_shares)
            self.bar.update(self.task, completed=step, status=status)

    def close(self) -> None:
        """Ends the bar; the run's training is over: batch_shares auto says what it settled on."""
        if self.bar is not None:
            self.bar.stop()
        summary = self.engine.batch_shares_summary()
        if summary is not None:
            self.engine.print(summary)


# -- after training --------------------------------------------------------------------------------------------
# How a run's result that the disk refused ends its sentence (core/atomic.py: refused_as_usage); the run's last
# checkpoint is written before its result, and a rerun writes the result from there (finish_complete_run).
RUN_RESULT = (
    "free space or make the directory writable, then run the same command again: it writes the result from the "
    "run's last checkpoint without training again."
)
EXPORT_RESULT = "free space or choose another OUT, then run the same command again."


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, advice: str) -> None:
    """`tensors` as one safetensors file (which needs contiguous tensors), whole or not at all (its directory made
    if missing); a disk's refusal is one sentence ending in `advice`."""

    def write(partial: Path) -> None:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(partial))
        give_usual_mode([partial])

    atomic.write_file(path, write, advice)


def export_checkpoint(directory: Path, out: Path, key: str = "model") -> None:
    """`multigpu export`: every shard of a checkpoint's model, read in this process, written to `out`, which is
    checked before anything is read."""
    checkpoint.model_metadata(directory, key)  # a checkpoint, and one that holds `key`
    check_new_output(out, "OUT", f"{out}/model.safetensors")
    tensors = checkpoint.full_model_state(directory, key=key)
    write_safetensors(tensors, out, EXPORT_RESULT)
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()):,} values) to {out}")
