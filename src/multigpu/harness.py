"""What `multigpu bench` and `multigpu verify` ask of a user's Engine script, and what the script reports back.

Both launch the script unchanged through `python -m multigpu.worker --harness DIR ...`. DIR/harness.json holds
a Harness: which strategy and precision to run whatever the script asks for, when to stop, whether to skip
gradient synchronisation. The Engine reads it once, at construction (and only inside such a worker), and each
rank writes DIR/rank{r}.json with its step records; with `dump_params` rank 0 also writes DIR/params.pt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from multigpu.errors import UsageError

_ACTIVE: Harness | None = None
_FINISH: Callable[[], None] | None = None  # the Engine's, once it exists


@dataclass
class Harness:
    directory: str
    strategy: str | None = None  # None: whatever the script asks for
    precision: str | None = None
    grad_accum_factor: int = 1  # verify's 1-process reference multiplies accumulation to keep the global batch
    warmup: int = 0  # optimizer steps before the timed ones
    steps: int | None = None  # timed optimizer steps; the run stops after warmup + steps
    grad_sync: bool = True  # False: no gradient communication, for bench's communication share
    record_loss: bool = False  # the global loss of every step (one extra scalar all-reduce per step)
    dump_params: bool = False  # rank 0 writes the full parameters when the run stops

    def save(self) -> None:
        Path(self.directory, "harness.json").write_text(json.dumps(asdict(self)))


class StopRun(SystemExit):
    """Ends the script after the harness's last step, as a clean exit (code 0) on every rank."""

    def __init__(self) -> None:
        super().__init__(0)


def activate(directory: str) -> None:
    global _ACTIVE
    _ACTIVE = Harness(**json.loads(Path(directory, "harness.json").read_text()))


def active() -> Harness | None:
    return _ACTIVE


def on_finish(finish: Callable[[], None]) -> None:
    global _FINISH
    _FINISH = finish


def finish() -> None:
    """Called by the worker when the script returns before the harness stopped it."""
    if _FINISH is not None:
        _FINISH()


@dataclass
class Recorder:
    """One rank's records of the steps it ran under the harness."""

    harness: Harness
    rank: int
    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False

    @property
    def last_step(self) -> int | None:
        return None if self.harness.steps is None else self.harness.warmup + self.harness.steps

    def add(self, record: dict[str, Any]) -> bool:
        """Keeps one optimizer step's record; True once the run has all the steps it asked for."""
        self.steps.append({"step": len(self.steps) + 1, **record})
        return self.last_step is not None and len(self.steps) >= self.last_step

    def dump_params(self, name: str, model: torch.nn.Module, state_dict: Callable[[torch.nn.Module], dict]) -> None:
        """Rank 0 writes the full parameters to DIR/`name`.pt. Collective under sharding: every rank calls it."""
        if not self.harness.dump_params:
            return
        full = state_dict(model)  # whole tensors on rank 0's CPU
        if self.rank == 0:
            torch.save({k: v.float() for k, v in full.items()}, Path(self.harness.directory, f"{name}.pt"))

    def finish(self, model: torch.nn.Module | None, state_dict: Callable, peak_memory: int) -> None:
        """Writes this rank's records, and the final parameters. Every rank calls it."""
        if self.finished:
            return
        self.finished = True
        if model is not None:
            self.dump_params("params", model, state_dict)
        record = {**self.meta, "peak_memory_bytes": peak_memory, "steps": self.steps}
        Path(self.harness.directory, f"rank{self.rank}.json").write_text(json.dumps(record))


def read_ranks(directory: Path, world_size: int) -> list[dict[str, Any]]:
    """Every rank's record from a finished harness run."""
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def run(target: list[str], module: bool, nproc: int, harness: Harness) -> list[dict[str, Any]]:
    """Runs the script in `nproc` processes under `harness`; returns every rank's record."""
    from multigpu.launch import LaunchConfig, launch

    harness.save()
    code = launch(LaunchConfig(nproc=nproc), target, module=module, harness_dir=Path(harness.directory))
    if code != 0:
        raise UsageError(
            f"{target[0]} failed in {nproc} process(es) with exit code {code} (its errors are above); "
            "fix it and run again."
        )
    directory = Path(harness.directory)
    if not (directory / "rank0.json").is_file():
        raise UsageError(
            f"{target[0]} finished without training through a multigpu Engine; bench and verify measure Engine scripts."
        )
    return read_ranks(directory, nproc)


def timed_steps(record: dict[str, Any], warmup: int) -> list[dict[str, Any]]:
    """The steps after warm-up that did nothing but train (no checkpoint, evaluation or FLOP count in between)."""
    return [s for s in record["steps"][warmup:] if not s["other_work"]]
