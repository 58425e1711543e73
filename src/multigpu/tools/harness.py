"""What `multigpu bench` and `multigpu verify` ask of a user's Engine script, and what the script reports back.

Both launch the script unchanged through `python -m multigpu.tools.harness DIR SCRIPT ...`: each process reads
DIR/harness.json, a Harness (which strategy and precision to run whatever the script asks for, when to stop,
whether to skip gradient synchronisation), attaches a Recorder to every Engine the script builds
(multigpu.observers.observe) and hands over to multigpu.launch.worker. Each rank writes DIR/rank{r}.json with its
step records; with `dump_params` rank 0 also writes DIR/initial_params.pt and DIR/params.pt.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from multigpu.core.errors import UsageError
from multigpu.engine import Engine, EngineConfig, StepObserver, StepStats, observe_every_engine
from multigpu.launch import worker
from multigpu.launch.launcher import LaunchConfig, launch
from multigpu.observers.monitor import Monitor, peak_memory_bytes
from multigpu.optimizers.build import state_bytes
from multigpu.parallel.compression import step_payload_bytes

#: The Engine settings that change what a step computes (its numbers), not how the processes split it: those verify
#: imposes on both its runs and bench on every run.
STEP_SETTINGS = ("precision", "activation_checkpointing", "compile", "compile_backend", "float8", "loss", "optimizer")


@dataclass
class Harness:
    directory: str
    #: Engine settings to run with whatever the script asks for (bench's and verify's strategy, precision, layout).
    engine: dict[str, Any] = field(default_factory=dict)
    grad_accum_factor: int = 1  # verify's 1-process reference multiplies accumulation to keep the global batch
    warmup: int = 0  # optimizer steps before the timed ones
    steps: int | None = None  # timed optimizer steps; the run stops after warmup + steps
    grad_sync: bool = True  # False: no gradient communication, for bench's communication share
    record_loss: bool = False  # the global loss of every step (one extra scalar all-reduce per step)
    dump_params: bool = False  # rank 0 writes the full parameters when the run stops
    read_inputs: bool = False  # record the ends of every input row of the first step (verify's same-samples check)
    expect_samples: int | None = None  # stop after the first step if it did not train on this many samples

    def save(self) -> None:
        Path(self.directory, "harness.json").write_text(json.dumps(asdict(self)))


class StopRun(SystemExit):
    """Ends the script after the harness's last step, as a clean exit (code 0) on every rank."""

    def __init__(self) -> None:
        super().__init__(0)


ROW_ENDS = 64  # values kept from each end of an input row: enough to tell samples apart, whatever the padding


def input_rows(args: tuple, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The first and last ROW_ENDS values of each sample of a forward's input: `input_ids` if given, else its
    first tensor argument. Padding to the batch's longest sample changes a row's length but not (right padding)
    its start or (left padding) its end."""
    tensors = [kwargs.get("input_ids"), *args, *kwargs.values()]
    tensor = next((t for t in tensors if torch.is_tensor(t) and t.dim() >= 1), None)
    if tensor is None:
        return []
    rows = tensor.detach().reshape(tensor.shape[0], -1)
    heads, tails = rows[:, :ROW_ENDS].cpu().tolist(), rows[:, -ROW_ENDS:].cpu().tolist()
    return [{"length": rows.shape[1], "head": h, "tail": t} for h, t in zip(heads, tails, strict=True)]


def per_batch_layers(model: torch.nn.Module) -> dict[str, list[str]]:
    """The layers whose output depends on how the batch is split or on the process's random stream."""
    named = [(name.removeprefix("module."), module) for name, module in model.named_modules()]
    batchnorm = [
        name
        for name, module in named
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, torch.nn.SyncBatchNorm)
    ]
    dropout = [name for name, module in named if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p]
    return {"batchnorm": batchnorm, "dropout": dropout}


class Recorder(StepObserver):
    """One rank's records of the steps it ran under the harness; it ends the run after the last step asked for."""

    synchronizes = True  # per-step times must include the GPU work queued in the step

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.wants_loss = harness.record_loss
        self.steps: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.model: torch.nn.Module | None = None
        self.first_rows: list[dict[str, Any]] = []  # the first step's input rows, with read_inputs
        self.finished = False

    def configure(self, config: EngineConfig) -> EngineConfig:
        """Bench and verify decide the strategy, precision and accumulation, whatever the script asks for."""
        if config.global_batch_size is not None:  # the script fixed the global batch: its accumulation follows
            return replace(config, **self.harness.engine)
        accumulation = config.grad_accum_steps * self.harness.grad_accum_factor
        return replace(config, **self.harness.engine, grad_accum_steps=accumulation)

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.monitor = next(observer for observer in engine.observers if isinstance(observer, Monitor))
        self.monitor.count_flops = True
        self.optimizer: torch.optim.Optimizer | None = None  # the one the script steps: bench measures its states
        register_optimizer_step_post_hook(lambda optimizer, *_: setattr(self, "optimizer", optimizer))
        _RECORDERS.append(self)

    def on_setup(self, model: torch.nn.Module) -> None:
        engine, self.model = self.engine, model
        self.meta = {
            "strategy": engine.strategy,
            "precision": engine.precision.name,
            "grad_compression": engine.config.grad_compression,
            "float8": engine.config.float8,
            "optimizer": engine.config.optimizer,
            "world_size": engine.world_size,
            "data_parallel_size": engine.data_parallel_size,
            "grad_accum_steps": engine.config.grad_accum_steps,
            "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
            "data_rank": engine.data_parallel_rank,
            "layers": per_batch_layers(model),
            # What each rank hands to the gradient collectives per step (bench: bytes sent per step).
            "gradient_bytes": step_payload_bytes(model, engine.config.grad_compression, engine.precision.param_dtype),
        }
        if self.harness.read_inputs:
            model.register_forward_pre_hook(self._read_inputs, with_kwargs=True)
        self._dump_params("initial_params")
        if not self.harness.grad_sync:
            # Entered for good: every backward keeps its gradients local (bench's communication share).
            engine.no_sync(model).__enter__()

    def _read_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.steps and torch.is_grad_enabled():  # the first step's training forwards, not an evaluation
            self.first_rows += input_rows(args, kwargs)

    def on_step_end(self, stats: StepStats) -> None:
        flops = self.monitor.flops_per_step
        record = {"time_s": stats.seconds, "samples": stats.samples, "tokens": stats.tokens, "loss": stats.loss}
        self.steps.append({"step": len(self.steps) + 1, **record, "flops": flops, "other_work": not stats.timed})
        last = None if self.harness.steps is None else self.harness.warmup + self.harness.steps
        expected = self.harness.expect_samples
        other_batch = len(self.steps) == 1 and expected is not None and step_samples([self.record()]) != expected
        if other_batch or (last is not None and len(self.steps) >= last):
            self.finish()
            raise StopRun()

    def _dump_params(self, name: str) -> None:
        """Rank 0 writes the full parameters to DIR/`name`.pt. Collective under sharding: every rank calls it."""
        if not self.harness.dump_params or self.model is None:
            return
        full = self.engine.full_state_dict(self.model, trainable_only=True)  # whole tensors on rank 0's CPU
        if self.engine.rank == 0:
            torch.save({k: v.float() for k, v in full.items()}, Path(self.harness.directory, f"{name}.pt"))

    def finish(self) -> None:
        """Writes this rank's records, and the final parameters. Every rank calls it."""
        if self.finished:
            return
        self.finished = True
        self._dump_params("params")
        Path(self.harness.directory, f"rank{self.engine.rank}.json").write_text(json.dumps(self.record()))

    def record(self) -> dict[str, Any]:
        held, elements = state_bytes(self.optimizer) if self.optimizer is not None else (0, 0)
        return {
            **self.meta,
            "peak_memory_bytes": peak_memory_bytes(self.engine.device),
            # This rank's optimizer states, the parameter elements they are for, and Muon's gathers per step.
            "optimizer_state_bytes": held,
            "optimizer_state_elements": elements,
            "optimizer_gathered_bytes": getattr(self.optimizer, "gathered_bytes", 0),
            "steps": self.steps,
            "first_step_rows": self.first_rows,
        }


_RECORDERS: list[Recorder] = []  # this process's, in the order the script built its Engines


def finish_recorders() -> None:
    """The script returned before the harness stopped it: what its last Engine recorded is written all the same."""
    if _RECORDERS:
        _RECORDERS[-1].finish()


def refuse_steps_without_an_engine(target: list[str]) -> None:
    """Makes the first optimizer step taken before any Engine was built raise a UsageError: a script that trains
    without an Engine gives the harness nothing to record, and would otherwise be run to its end to find that out.
    (Every torch optimizer, the ones Trainer, accelerate and Lightning drive included, calls the global hook.)"""
    name = target[1] if target[0] == "-m" else target[0]

    def before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        if not _RECORDERS:
            raise UsageError(
                f"{name} took an optimizer step without a multigpu Engine, and bench and verify measure only scripts "
                "that train through one; build an Engine in it (docs/guide.md, from one GPU to many), or run it as "
                "it is with multigpu run."
            )

    register_optimizer_step_pre_hook(before_step)


def main() -> None:
    """`python -m multigpu.tools.harness DIR [-m] TARGET [ARGS...]`: one process of a bench or verify run."""
    directory, *target = sys.argv[1:]
    harness = Harness(**json.loads(Path(directory, "harness.json").read_text()))
    observe_every_engine(lambda: Recorder(harness))
    refuse_steps_without_an_engine(target)
    worker.main(target, after=finish_recorders)


def first_step_rows(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input rows of a run's first step, one data-parallel rank's copy each (tensor-parallel ranks share it)."""
    readers = {rank["data_rank"]: rank["first_step_rows"] for rank in reversed(ranks)}
    return [row for data_rank in sorted(readers) for row in readers[data_rank]]


def step_samples(ranks: list[dict[str, Any]]) -> int | None:
    """How many samples a run's first step trained on: its input rows, or the engine loader's count; None when
    neither is known (a pipeline's inputs never pass the model's own forward; a loader of the script's own)."""
    rows = first_step_rows(ranks)
    if rows:
        return len(rows)
    samples = ranks[0]["steps"][0]["samples"] if ranks[0]["steps"] else 0
    return samples or None


def read_ranks(directory: Path, world_size: int) -> list[dict[str, Any]]:
    """Every rank's record from a finished harness run."""
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def run(
    target: list[str], module: bool, nproc: int, harness: Harness, launching: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Runs the script in `nproc` processes under `harness`; returns every rank's record. `launching`: LaunchConfig
    settings the tool shows (share_gpus: several processes on each GPU; ray: on a Ray cluster)."""
    harness.save()
    worker = ("multigpu.tools.harness", harness.directory)
    code = launch(LaunchConfig(nproc=nproc, **(launching or {})), target, module=module, worker=worker)
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


if __name__ == "__main__":
    main()
