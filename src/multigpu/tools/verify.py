"""`multigpu verify`: does the script compute on N processes what it computes on one?

The script runs twice, unchanged, under the harness: once in 1 process with the `single` strategy and N times
the gradient accumulation (so every optimizer step sees the same global batch), once in N processes with the
strategy under test. Both record the global loss of every step and the parameters before the first step and
after the last. The engine loader gives both runs the same global batches, so any difference beyond rounding
is a bug: randomness drawn per process instead of per sample, a loss normalised per rank, a model built
differently on each rank, a layer that depends on the per-device batch.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from multigpu.core.errors import UsageError
from multigpu.core.precision import PRECISIONS
from multigpu.strategies import STRATEGIES
from multigpu.tools import harness

# (loss: relative difference per step, parameters: difference as a fraction of how far training moved them).
# fp32 differs only by summation order; 16-bit compute rounds each step's activations and gradients.
# Adam turns a gradient's rounding noise into an update of up to the learning rate, hence the looser 16-bit bounds.
TOLERANCES = {"32": (1e-4, 1e-3), "bf16-mixed": (3e-2, 0.3), "fp16-mixed": (1e-2, 0.15), "bf16-true": (5e-2, 0.5)}


@dataclass
class VerifyConfig:
    nproc: int = field(
        default=2, metadata={"help": "processes to compare with one (default: 2; 1 with --strategy, for one GPU)"}
    )
    strategy: str | None = field(
        default=None,
        metadata={"help": "strategy for the N-process run (default: the script's own)", "choices": STRATEGIES},
    )
    precision: str | None = field(
        default=None, metadata={"help": "precision for both runs (default: the script's own)", "choices": PRECISIONS}
    )
    tp_size: int | None = field(
        default=None, metadata={"help": "tensor-parallel degree of the N-process run (with --strategy zero3, ...)"}
    )
    pp_size: int | None = field(
        default=None, metadata={"help": "pipeline degree of the N-process run (with --strategy pp, zero3, ...)"}
    )
    steps: int = field(default=20, metadata={"help": "optimizer steps to compare"})
    loss_tolerance: float | None = field(
        default=None, metadata={"help": "allowed relative loss difference per step (default: by precision)"}
    )
    param_tolerance: float | None = field(
        default=None,
        metadata={"help": "allowed parameter difference, as a fraction of the training update (default: by precision)"},
    )

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc must be 1 or more (got {self.nproc}).")
        if self.nproc == 1 and self.strategy in (None, "single", "auto"):
            # One process under a real strategy (on one GPU: NCCL in a group of one) still checks its wrapping,
            # sharding and precision against the plain run; without one there is nothing to compare.
            raise UsageError(
                "--nproc 1 compares one process with itself; pass --strategy (e.g. zero3) to check that strategy "
                "in one process, or --nproc 2 or more."
            )
        for name in ("tp_size", "pp_size"):
            size = getattr(self, name)
            if size is not None and (self.strategy is None or self.nproc % size):
                raise UsageError(
                    f"--{name.replace('_', '-')} {size} needs --strategy (tp, pp, zero2, zero3 or hsdp) and a --nproc "
                    f"it divides (got {self.nproc}); give both."
                )
        if self.steps < 1:
            raise UsageError(f"--steps must be 1 or more (got {self.steps}).")
        for name in ("loss_tolerance", "param_tolerance"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive (got {value}).")


@dataclass
class Verdict:
    passed: bool
    nproc: int
    strategy: str
    precision: str
    loss_tolerance: float
    param_tolerance: float
    steps: list[dict[str, Any]]  # step, loss_1, loss_n, relative difference
    first_divergence: int | None  # the first step whose loss differs beyond the tolerance
    initial_param_diff: float  # max |difference| of the parameters before training
    param_diff: float  # max |difference| after the last step, relative to the largest update
    worst_param: str
    reason: str


def verify(config: VerifyConfig, target: list[str], module: bool = False) -> Verdict:
    """Runs the script in 1 and in N processes and compares them step by step."""
    with tempfile.TemporaryDirectory(prefix="multigpu-verify-") as tmp:
        one, many = Path(tmp, "one"), Path(tmp, "many")
        one.mkdir()
        many.mkdir()
        common = {"precision": config.precision, "steps": config.steps, "record_loss": True, "dump_params": True}
        # One process stands in for the N-process run's data-parallel ranks (tensor and pipeline ones share a batch).
        tp = config.tp_size or (config.nproc if config.strategy == "tp" else 1)
        pp = config.pp_size or (config.nproc // tp if config.strategy == "pp" else 1)
        replicas = max(1, config.nproc // (tp * pp))
        reference = harness.Harness(str(one), strategy="single", grad_accum_factor=replicas, **common)
        ref = harness.run(target, module, 1, reference)[0]
        layout = {"tp_size": config.tp_size, "pp_size": config.pp_size}
        under_test = harness.Harness(str(many), strategy=config.strategy, **layout, **common)
        dist = harness.run(target, module, config.nproc, under_test)[0]
        return compare(config, ref, dist, _params(one), _params(many))


def _params(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return torch.load(folder / "initial_params.pt"), torch.load(folder / "params.pt")


def compare(
    config: VerifyConfig,
    ref: dict[str, Any],
    dist: dict[str, Any],
    ref_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    dist_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> Verdict:
    loss_tol, param_tol = TOLERANCES[dist["precision"]]
    loss_tol = config.loss_tolerance or loss_tol
    param_tol = config.param_tolerance or param_tol
    steps, first = [], None
    for a, b in zip(ref["steps"], dist["steps"], strict=False):
        diff = abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
        steps.append({"step": a["step"], "loss_1": a["loss"], "loss_n": b["loss"], "relative_diff": diff})
        if first is None and not diff <= loss_tol:  # NaN fails too
            first = a["step"]
    (ref_init, ref_final), (dist_init, dist_final) = ref_params, dist_params
    if set(ref_final) != set(dist_final):
        raise UsageError("The 1- and N-process runs built models with different parameter names; build one model.")
    initial = max(float((ref_init[k] - dist_init[k]).abs().max()) for k in ref_init)
    update = max(float((ref_final[k] - ref_init[k]).abs().max()) for k in ref_final)
    diffs = {k: float((ref_final[k] - dist_final[k]).abs().max()) / max(update, 1e-12) for k in ref_final}
    worst = max(diffs, key=diffs.get)
    reason = ""
    if len(ref["steps"]) != len(dist["steps"]):
        reason = f"the runs made {len(ref['steps'])} and {len(dist['steps'])} optimizer steps"
    elif initial > 0:
        reason = f"the parameters differ by up to {initial:.3g} before training: the model is built differently"
    elif first is not None:
        reason = f"the loss diverged at step {first}"
    elif not diffs[worst] <= param_tol:
        reason = f"the final parameters differ by {diffs[worst]:.3g} of the update (in {worst})"
    return Verdict(
        passed=not reason,
        nproc=dist["world_size"],
        strategy=dist["strategy"],
        precision=dist["precision"],
        loss_tolerance=loss_tol,
        param_tolerance=param_tol,
        steps=steps,
        first_divergence=first,
        initial_param_diff=initial,
        param_diff=diffs[worst],
        worst_param=worst,
        reason=reason,
    )


def print_verdict(verdict: Verdict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(verdict), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    n = verdict.nproc
    table = Table(title=f"1 process vs {n} ({verdict.strategy}, precision {verdict.precision})")
    for column in ("step", "loss, 1 process", f"loss, {n} processes", "relative difference", ""):
        table.add_column(column, justify="right")
    for s in verdict.steps:
        ok = s["relative_diff"] <= verdict.loss_tolerance
        mark = (
            "" if ok else ("[red]first divergence[/red]" if s["step"] == verdict.first_divergence else "[red]x[/red]")
        )
        table.add_row(str(s["step"]), f"{s['loss_1']:.6f}", f"{s['loss_n']:.6f}", f"{s['relative_diff']:.2e}", mark)
    console = Console()
    console.print(table)
    console.print(
        f"parameters after the last step: max difference {verdict.param_diff:.3g} of the largest update "
        f"(tolerance {verdict.param_tolerance:g}); loss tolerance {verdict.loss_tolerance:g} relative"
    )
    if verdict.passed:
        console.print(f"[green]PASS[/green]: {n} processes compute what 1 process computes.")
    else:
        console.print(f"[red]FAIL[/red]: {verdict.reason}. {ADVICE}")


ADVICE = (
    "Usual causes: random numbers drawn per process (seed augmentation and dropout per sample, not per rank), "
    "a loss averaged per rank over tokens (sum it and pass count= to engine.backward), or layers that "
    "depend on the per-device batch (BatchNorm: use SyncBatchNorm or GroupNorm)."
)
