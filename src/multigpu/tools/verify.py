"""`multigpu verify`: does the script compute on N processes what it computes on one?

The script runs twice, unchanged, under the harness: once in N processes with the strategy under test, then in
1 process with the `single` strategy and N times the gradient accumulation, so that every optimizer step sees
the same global batch. A script that derives its per-process batch from the world size (a fixed global batch)
trains on a different number of samples in one process; the reference is then run again with the accumulation
that matches, or refused when none does. Both runs record the global loss of every step, the parameters before
the first step and after the last, and the input rows of the first step. The engine loader gives both runs the
same global batches, so any difference beyond rounding is a bug; a FAIL names the causes verify found (other
samples read, parameters built differently, BatchNorm, dropout) and says what it could not check.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from multigpu.config.settings import (
    Settings,
    override,
    override_group,
    setting,
    shown,
    shown_group,
    strategy_option_fields,
)
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.launch.launcher import RAY, LaunchConfig
from multigpu.strategies import STRATEGY_CLASSES, drives_gpus_in_process, plain_single_process
from multigpu.tools import harness

# (loss: relative difference per step, parameters: difference as a fraction of how far training moved them).
# fp32 differs only by summation order; 16-bit compute rounds each step's activations and gradients.
# Adam turns a gradient's rounding noise into an update of up to the learning rate, hence the looser 16-bit bounds.
TOLERANCES = {"32": (1e-4, 1e-3), "bf16-mixed": (3e-2, 0.3), "fp16-mixed": (1e-2, 0.15), "bf16-true": (5e-2, 0.5)}


# Gradients reduced in 16 bits round them as a 16-bit precision's all-reduce does: that precision's tolerances.
COMPRESSION_TOLERANCES = {"bf16": TOLERANCES["bf16-mixed"], "fp16": TOLERANCES["fp16-mixed"]}
# float8 tensorwise scales each rank's activations and gradients by that rank's own largest value, so the rounding
# changes with the split: measured 5.4e-4 of the loss and 0.95 of an update after 4 AdamW steps (Adam moves a
# parameter whose small gradient the rounding flips by up to 2 updates). rowwise scales each row alone: exact.
FLOAT8_TOLERANCES = {"tensorwise": (5e-3, 2.0)}
# Muon's Newton-Schulz runs in bfloat16 (torch's), so a gradient's last-bit differences between the runs round a few
# of its inputs apart, and its iterations spread that over the update: measured on nanoGPT under zero3 after 6
# steps, 1.9e-6 of the loss and 0.038 of an update; a Newton-Schulz run on each shard alone, the error to catch,
# moved them by 5.2e-4 and 0.61.
OPTIMIZER_TOLERANCES = {"muon": (1e-4, 0.15)}
# The parameters' own rounding, which the parameter bound leaves out (param_differences): units in the last place of
# each element, of the format its run stores it in (float32 masters, except under bf16-true). Two: one rounding
# apart, and once more for an element the runs round apart in a second step.
ROUNDING_ULPS = 2
STORED_EPS = {"bf16-true": torch.finfo(torch.bfloat16).eps}


def default_tolerances(dist: dict[str, Any], config: VerifyConfig) -> tuple[float, float]:
    """(loss, parameter) tolerances of the N-process run's precision, or of its gradient compression where looser;
    PowerSGD approximates every step's gradient by design, so there is no default to compare it with."""
    compression = dist.get("grad_compression", "none")
    if compression.startswith("powersgd") and (config.loss_tolerance is None or config.param_tolerance is None):
        raise UsageError(
            "grad_compression powersgd approximates each step's gradient (its error feedback evens that out over "
            "steps), so 1 process and N differ by design; pass --loss-tolerance and --param-tolerance, or verify "
            "without it."
        )
    candidates = [
        TOLERANCES[dist["precision"]],
        COMPRESSION_TOLERANCES.get(compression, (0, 0)),
        FLOAT8_TOLERANCES.get(dist.get("float8", "none"), (0, 0)),
        OPTIMIZER_TOLERANCES.get(dist.get("optimizer", "adamw"), (0, 0)),
    ]
    return max(loss for loss, _ in candidates), max(param for _, param in candidates)


# The settings given to verify that the 1-process run takes too: what is computed, not how the processes split it.
BOTH_RUNS_TAKE = harness.STEP_SETTINGS
# What a setting verify imposes means there.
BOTH_RUNS = "; verify: both runs' (default: the script's own)"
N_PROCESS_RUN = "; verify: the N-process run's"
WITH_STRATEGY = "; verify: the N-process run's, with --strategy"
# The degrees and the split of layers the N-process run takes (with --strategy).
WITH_STRATEGY_TAKE = ("tp_size", "pp_size", "pp_split", "cp_size", "ep_size")


@dataclass
class VerifyConfig(Settings):
    """`multigpu verify`'s flags: the Engine settings it imposes on the script (each unset by default: the script's
    own; config/settings.py: override), then its own."""

    strategy: str | None = override(EngineConfig, note=f"{N_PROCESS_RUN} (default: the script's own)")
    _both_runs = override_group(EngineConfig, *BOTH_RUNS_TAKE, note=BOTH_RUNS)
    _with_strategy = override_group(EngineConfig, *WITH_STRATEGY_TAKE, note=WITH_STRATEGY)
    _n_process_run = override_group(EngineConfig, "cp_method", "batch_shares", note=N_PROCESS_RUN)
    grad_compression: str | None = override(EngineConfig, note=f"{N_PROCESS_RUN} (default: the script's own)")
    nproc: int | None = setting(
        None, "processes to compare with one (default: 2, or 1 under dp; 1 with --strategy, for one GPU)"
    )
    share_gpus: bool = shown(LaunchConfig)
    _ray = shown_group(LaunchConfig, *RAY)
    steps: int = setting(20, "optimizer steps to compare")
    loss_tolerance: float | None = setting(None, "allowed relative loss difference per step (default: by precision)")
    param_tolerance: float | None = setting(
        None, "allowed parameter difference, as a fraction of the training update (default: by precision)"
    )

    def check(self) -> None:
        if drives_gpus_in_process(self.strategy) and self.nproc not in (None, 1):
            raise UsageError(
                f"--strategy dp is one process that drives every GPU, so there are no {self.nproc} processes to "
                "launch; drop --nproc."
            )
        if self.nproc is None:
            self.nproc = 1 if drives_gpus_in_process(self.strategy) else 2
        if self.nproc < 1:
            raise UsageError(f"--nproc must be 1 or more (got {self.nproc}).")
        if self.nproc == 1 and (self.strategy not in STRATEGY_CLASSES or plain_single_process(self.strategy)):
            # One process under a real strategy (on one GPU: NCCL in a group of one) still checks its wrapping,
            # sharding and precision against the plain run; without one there is nothing to compare.
            raise UsageError(
                "--nproc 1 compares one process with itself; pass --strategy (e.g. zero3) to check that strategy "
                "in one process, or --nproc 2 or more."
            )
        for name in ("tp_size", "pp_size", "cp_size", "ep_size"):
            size = getattr(self, name)
            if size is not None and (self.strategy is None or self.nproc % size):
                raise UsageError(
                    f"--{name.replace('_', '-')} {size} needs --strategy (ddp, tp, pp, zero2, zero3 or hsdp) and a "
                    f"--nproc it divides (got {self.nproc}); give both."
                )
        if self.steps < 1:
            raise UsageError(f"--steps must be 1 or more (got {self.steps}).")
        for name in ("loss_tolerance", "param_tolerance"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive finite number (got {value}).")


@dataclass
class Verdict:
    passed: bool
    nproc: int
    strategy: str
    precision: str
    loss_tolerance: float
    param_tolerance: float
    samples_per_step: int | None  # the global batch of both runs' first step, where verify could count it
    reference_grad_accum: int  # the 1-process run's accumulation multiplier that gives it that global batch
    steps: list[dict[str, Any]]  # step, loss_1, loss_n, relative difference
    first_divergence: int | None  # the first step whose loss differs beyond the tolerance
    initial_param_diff: float  # max |difference| of the parameters before training
    param_diff: float  # max |difference| after the last step beyond rounding, relative to the largest update
    worst_param: str
    reason: str
    causes: list[str]  # what verify found that makes N processes differ from 1
    checked: list[str]  # what it checked and found in order
    unchecked: list[str]  # what could explain a FAIL but verify cannot see


def verify(config: VerifyConfig, target: list[str], module: bool = False) -> Verdict:
    """Runs the script in N processes and in 1, on the same global batches, and compares them step by step."""
    if drives_gpus_in_process(config.strategy) and torch.cuda.device_count() < 2:
        raise UsageError(
            f"--strategy dp splits each batch over the GPUs of one process, and this machine has "
            f"{torch.cuda.device_count()}, so it would run as single; verify dp on a machine with 2 or more GPUs, "
            "or verify ddp."
        )
    assert config.nproc is not None  # set by VerifyConfig
    with tempfile.TemporaryDirectory(prefix="multigpu-verify-") as tmp:
        common = {"steps": config.steps, "record_loss": True, "dump_params": True, "read_inputs": True}
        # A strategy given replaces the script's, its layout with it (the script's own tp_size, pp_size dropped).
        imposed = config.values_for(EngineConfig)
        if config.strategy is not None:
            imposed |= {name: getattr(config, name) for name in ("tp_size", "pp_size", "cp_size", "ep_size")}
        many = _folder(tmp, "many")
        launching = config.values_for(LaunchConfig)  # --share-gpus and --ray; the 1-process runs only --ray
        on_ray = {name: value for name, value in launching.items() if name in RAY}
        dist = harness.run(target, module, config.nproc, harness.Harness(str(many), imposed, **common), launching)
        samples = harness.step_samples(dist)
        # One process stands in for the N-process run's data-parallel ranks (tensor and pipeline ones share a batch).
        factor = dist[0]["data_parallel_size"]
        both = {key: value for key, value in imposed.items() if key in BOTH_RUNS_TAKE}
        # The reference runs plain: no strategy's options (the script's own cpu_offload or grad_compression).
        plain = {option.name: option.default for _, option in strategy_option_fields()}
        layout = dict.fromkeys(("tp_size", "pp_size", "cp_size", "ep_size"))
        reference = {**plain, "strategy": "single", **layout, **both}
        one = _folder(tmp, "one")
        ref = harness.run(target, module, 1, _reference(one, reference, factor, samples, common), on_ray)
        ref_samples = harness.step_samples(ref)
        if samples is not None and ref_samples is not None and ref_samples != samples:
            # The script sized its batch by the world size: accumulate the 1-process batch as often as it takes.
            factor, left = divmod(samples * factor, ref_samples)
            if left or factor < 1:
                raise UsageError(
                    f"The script's first step trains on {samples} samples in {config.nproc} processes but on "
                    f"{ref_samples} in 1, and no accumulation of the 1-process batch makes up {samples}; give the "
                    "script a global batch that is a multiple of its 1-process batch."
                )
            one = _folder(tmp, "one-again")
            ref = harness.run(target, module, 1, _reference(one, reference, factor, samples, common), on_ray)
        return compare(config, ref, dist, _params(one), _params(many), factor)


def _folder(tmp: str, name: str) -> Path:
    folder = Path(tmp, name)
    folder.mkdir()
    return folder


def _reference(
    folder: Path, imposed: dict[str, Any], factor: int, samples: int | None, common: dict[str, Any]
) -> harness.Harness:
    return harness.Harness(str(folder), imposed, grad_accum_factor=factor, expect_samples=samples, **common)


def _params(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return torch.load(folder / "initial_params.pt"), torch.load(folder / "params.pt")


def compare(
    config: VerifyConfig,
    ref_ranks: list[dict[str, Any]],
    dist_ranks: list[dict[str, Any]],
    ref_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    dist_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    reference_grad_accum: int = 1,
) -> Verdict:
    ref, dist = ref_ranks[0], dist_ranks[0]
    loss_tol, param_tol = default_tolerances(dist, config)
    loss_tol = config.loss_tolerance or loss_tol
    param_tol = config.param_tolerance or param_tol
    steps, first = [], None
    for a, b in zip(ref["steps"], dist["steps"], strict=False):
        diff = abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
        steps.append({"step": a["step"], "loss_1": a["loss"], "loss_n": b["loss"], "relative_diff": diff})
        if first is None and not diff <= loss_tol:  # NaN fails too
            first = a["step"]
    initial, diffs = param_differences(ref_params, dist_params, dist["precision"])
    worst = max(diffs, key=diffs.get)
    reason = ""
    if len(ref["steps"]) != len(dist["steps"]):
        reason = f"the runs made {len(ref['steps'])} and {len(dist['steps'])} optimizer steps"
    elif initial > 0:
        reason = f"the parameters differ by up to {initial:.3g} before training"
    elif first is not None:
        reason = f"the loss diverged at step {first}"
    elif not diffs[worst] <= param_tol:
        reason = f"the final parameters differ by {diffs[worst]:.3g} of the update (in {worst})"
    causes, checked, unchecked = diagnose(ref_ranks, dist_ranks, initial)
    return Verdict(
        passed=not reason,
        nproc=dist["world_size"],
        strategy=dist["strategy"],
        precision=dist["precision"],
        loss_tolerance=loss_tol,
        param_tolerance=param_tol,
        samples_per_step=harness.step_samples(dist_ranks),
        reference_grad_accum=reference_grad_accum,
        steps=steps,
        first_divergence=first,
        initial_param_diff=initial,
        param_diff=diffs[worst],
        worst_param=worst,
        reason=reason,
        causes=causes,
        checked=checked,
        unchecked=unchecked,
    )


def param_differences(
    ref_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    dist_params: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    precision: str,
) -> tuple[float, dict[str, float]]:
    """(the largest difference before training, each parameter's difference after it beyond its own rounding, as a
    fraction of the largest update the 1-process run made).

    Both runs round every parameter to its stored format after each update. Where the updates are tiny beside the
    parameters (a learning-rate warm-up's first steps), an update difference far inside the tolerance still rounds
    some element of the two runs one unit in the last place apart: a fixed amount that, divided by a tiny update,
    would pass or fail a correct run by chance (0.0008 of a 0.001 bound at a nanoGPT warm-up). ROUNDING_ULPS of each
    element's own magnitude are taken off its difference first; a bug moves parameters by a share of the update
    itself, which stays."""
    (ref_init, ref_final), (dist_init, dist_final) = ref_params, dist_params
    if set(ref_final) != set(dist_final):
        raise UsageError("The 1- and N-process runs built models with different parameter names; build one model.")
    initial = max(float((ref_init[k] - dist_init[k]).abs().max()) for k in ref_init)
    update = max(max(float((ref_final[k] - ref_init[k]).abs().max()) for k in ref_final), 1e-12)
    eps = STORED_EPS.get(precision, torch.finfo(torch.float32).eps)
    diffs = {}
    for k in ref_final:
        rounding = ROUNDING_ULPS * eps * torch.maximum(ref_final[k].abs(), dist_final[k].abs())
        beyond = ((ref_final[k] - dist_final[k]).abs() - rounding).clamp(min=0)
        diffs[k] = float(beyond.max()) / update if beyond.numel() else 0.0
    return initial, diffs


def diagnose(
    ref_ranks: list[dict[str, Any]], dist_ranks: list[dict[str, Any]], initial_param_diff: float
) -> tuple[list[str], list[str], list[str]]:
    """(causes found, checks passed, what verify cannot see) for the two runs' records."""
    causes, checked, unchecked = [], [], []
    if initial_param_diff > 0:
        causes.append(
            f"the parameters differ by up to {initial_param_diff:.3g} before the first step: the model is built "
            "differently in 1 and in N processes (seed it before building it, the same on every rank)"
        )
    else:
        checked.append("the parameters were equal before the first step")
    samples = same_samples(harness.first_step_rows(ref_ranks), dist_ranks)
    if samples is None:
        unchecked.append("which samples each run read (its inputs never passed the model's own forward)")
    elif samples:
        causes.append(samples)
    else:
        checked.append("both runs' first step read the same samples")
    layers = dist_ranks[0]["layers"]
    if layers["batchnorm"]:
        causes.append(
            f"the model has BatchNorm ({', '.join(layers['batchnorm'][:3])}), which normalises over each process's "
            "own batch (convert it with sync_batchnorm=True on GPUs, or use GroupNorm or LayerNorm)"
        )
    if layers["dropout"]:
        causes.append(
            f"the model has dropout ({', '.join(layers['dropout'][:3])}), whose masks come from each process's own "
            "random stream (verify with dropout set to 0)"
        )
    if not layers["batchnorm"] and not layers["dropout"]:
        checked.append("the model has no BatchNorm or dropout module")
    if not any(step["tokens"] for rank in dist_ranks for step in rank["steps"]):
        unchecked.append(
            "whether the loss is a mean over tokens: engine.backward got no count=, so each process's loss counts as "
            "a mean over its own batch; a mean over tokens, whose number differs between processes, must be returned "
            "as (sum, count)"
        )
    return causes, checked, unchecked


def same_samples(ref_rows: list[dict[str, Any]], dist_ranks: list[dict[str, Any]]) -> str | None:
    """ "" when both runs' first step read the same samples; what differs, if they did not; None if unknown.

    Rows are compared by their first or their last values (as many as the shortest row has), so that padding to
    each batch's longest sample, on the right or on the left, does not count as a difference."""
    dist_rows = harness.first_step_rows(dist_ranks)
    if not ref_rows or not dist_rows:
        return None
    if len(ref_rows) != len(dist_rows):
        return f"the first step trained on {len(ref_rows)} samples in 1 process and {len(dist_rows)} in N"
    width = min(row["length"] for row in [*ref_rows, *dist_rows])
    if any(_ends(ref_rows, end, width) == _ends(dist_rows, end, width) for end in ("head", "tail")):
        return ""
    readers = {rank["data_rank"]: rank["first_step_rows"] for rank in dist_ranks}
    if len(readers) > 1 and all(rows == readers[0] for rows in readers.values()):
        return (
            "every process read the same samples in the first step: the data is not split between processes "
            "(iterate engine.dataloader(...), or give your DataLoader a DistributedSampler)"
        )
    return "the two runs' first steps read different samples, though as many (a data order that depends on N)"


def _ends(rows: list[dict[str, Any]], end: str, width: int) -> Counter:
    """The multiset of the rows' first (`end` "head") or last ("tail") `width` values."""
    return Counter(tuple(row["head"][:width] if end == "head" else row["tail"][-width:]) for row in rows)


def print_verdict(verdict: Verdict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(verdict), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    n = verdict.nproc
    table = Table(title=f"1 process vs {n} ({verdict.strategy}, precision {verdict.precision})")
    beyond = [not s["relative_diff"] <= verdict.loss_tolerance for s in verdict.steps]  # NaN is beyond too
    columns = ["step", "loss, 1 process", f"loss, {n} processes", "relative difference"]
    for column in [*columns, "beyond tolerance"] if any(beyond) else columns:  # a column only where it says something
        table.add_column(column, justify="right")
    for s, over in zip(verdict.steps, beyond, strict=True):
        row = [str(s["step"]), f"{s['loss_1']:.6f}", f"{s['loss_n']:.6f}", f"{s['relative_diff']:.2e}"]
        if any(beyond):
            first = s["step"] == verdict.first_divergence
            row.append("[red]first divergence[/red]" if first else "[red]yes[/red]" if over else "no")
        table.add_row(*row)
    console = Console(width=None if sys.stdout.isatty() else 150)  # a log or a pipe gets whole lines, as plan's
    console.print(table)
    console.print(
        f"parameters after the last step: max difference {verdict.param_diff:.3g} of the largest update beyond "
        f"{ROUNDING_ULPS} units of rounding (tolerance {verdict.param_tolerance:g}); loss tolerance "
        f"{verdict.loss_tolerance:g} relative"
    )
    batch = "" if verdict.samples_per_step is None else f"global batch {verdict.samples_per_step} samples; "
    console.print(f"{batch}the 1-process run accumulated {verdict.reference_grad_accum}x the script's micro-batches")
    if verdict.passed:
        console.print(f"[green]PASS[/green]: {n} processes compute what 1 process computes.")
        return
    console.print(f"[red]FAIL[/red]: {verdict.reason}.")
    for cause in verdict.causes:
        console.print(f"  found: {cause}")
    if not verdict.causes:
        console.print(f"  verify found none of the causes it checks: {'; '.join(verdict.checked)}.")
    for blind_spot in verdict.unchecked:
        console.print(f"  not checked: {blind_spot}")
