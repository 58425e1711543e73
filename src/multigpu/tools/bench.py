"""`multigpu bench`: throughput, speedup and memory of a script or recipe at several process counts and strategies.

Each cell (process count x strategy x repeat) runs the script unchanged under the harness, which times every
optimizer step after warm-up, skipping steps that also checkpointed or evaluated. The per-device batch is the
script's own, so N processes train N times the samples per step (weak scaling, as the guides' tables do).
The communication share is measured: the same cell again with gradient synchronisation switched off, and
1 - (step time without sync / with it) is the part of the step spent waiting for gradient communication.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from multigpu.config.flags import parse_list
from multigpu.config.settings import Settings, override_group, setting, shown_group
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.launch.launcher import RAY, LaunchConfig
from multigpu.parallel.compression import CompressionOptions, refuse_powersgd, wire_factor
from multigpu.strategies import STRATEGY_CLASSES, Strategy, strategy_class
from multigpu.tools import harness


def reducing(strategy: str) -> bool:
    """Whether bench counts `strategy`'s gradient collectives (bytes sent per step) and runs it with each
    grad_compression: one data-parallel ring (strategies/facts.py: its communication). tp reduces no gradients;
    hsdp's cross two groups, which one ring's share does not count."""
    communication = strategy_class(strategy).facts.communication
    return communication is not None and not communication.across_replicas


def plain() -> str:
    """The one-process baseline: the first registered strategy that runs one process on one device (single)."""
    return next(n for n, c in ((n, strategy_class(n)) for n in STRATEGY_CLASSES) if _single_process(c))


def _single_process(cls: type[Strategy]) -> bool:
    return cls.facts.one_process and not cls.spread.gpus_in_process


RECIPES = {
    "train": ["multigpu.recipes.train", "--resume", "none", "--epochs", "1000", "--log-every", "0"],
    # Evaluation happens before the first step, which is never timed: one batch is enough.
    "finetune": [
        *("multigpu.recipes.finetune", "--resume", "none", "--epochs", "1000", "--log-every", "0"),
        *("--eval-batches", "1"),
    ],
}


# What a setting bench imposes means there.
EVERY_RUN = "; bench: every run's (default: the script's own)"
EVERY_MULTI_PROCESS_RUN = "; bench: every multi-process run's (each process count a multiple of it)"


@dataclass
class BenchConfig(Settings):
    """`multigpu bench`'s flags: the Engine settings it imposes on every run (each unset by default: the script's
    own; config/settings.py: override), then its own."""

    _every_run = override_group(EngineConfig, *harness.STEP_SETTINGS, note=EVERY_RUN)
    _every_multi_process_run = override_group(EngineConfig, "cp_size", "ep_size", note=EVERY_MULTI_PROCESS_RUN)
    nproc: str = setting("1,2", "comma-separated process counts, e.g. 1,2,4")
    # --strategy and --multi-gpu as well: the strategy's flags on the other verbs, here taking a list.
    strategies: str = setting(
        "ddp", "comma-separated strategies, e.g. ddp,zero2,zero3", aliases=("strategy", "multi_gpu")
    )
    grad_compressions: str = setting(
        "none", "comma-separated grad_compression values to run each strategy with, e.g. none,bf16,powersgd"
    )
    steps: int = setting(50, "timed optimizer steps per run")
    warmup: int = setting(5, "optimizer steps before timing starts")
    repeats: int = setting(3, "runs per cell (min / median / max are reported)")
    recipe: str | None = setting(None, "bench a built-in recipe instead of SCRIPT", choices=tuple(RECIPES))
    comm_share: bool = setting(True, "also run each multi-process cell without gradient sync, to measure it")
    out: str = setting("bench", "directory for bench.json, speedup.png and memory.png")
    baseline: str = setting(
        "single",
        "the 1-process run speedups are taken over: plain single-process training, or each strategy itself on 1 "
        "process (separates a strategy's own overhead from its communication)",
        choices=("single", "same"),
    )
    _ray = shown_group(LaunchConfig, *RAY)

    def check(self) -> None:
        self.counts = parse_list(self.nproc, "--nproc", int)
        if any(n < 1 for n in self.counts):
            raise UsageError(f"--nproc {self.nproc} must list process counts of 1 or more, e.g. 1,2,4.")
        self.strategy_names = parse_list(self.strategies, "--strategies", str)
        # A strategy that runs in one process is no cell of its own: one process runs as the baseline.
        unknown = [s for s in self.strategy_names if s not in STRATEGY_CLASSES or strategy_class(s).facts.one_process]
        if unknown:
            among = ", ".join(name for name in STRATEGY_CLASSES if reducing(name))
            raise UsageError(
                f"--strategies has {', '.join(unknown)}; choose among {among} "
                "(1 process always runs as the single-process baseline)."
            )
        self.compressions = parse_list(self.grad_compressions, "--grad-compressions", str)
        for compression in self.compressions:  # each checked as the Engine's setting is, before any launch
            CompressionOptions(grad_compression=compression)
            for strategy in dict.fromkeys(self.strategy_names):
                cls = strategy_class(strategy)  # powersgd: a feature it composes with (DDP's communication hook)
                if cls.facts.reduces_gradients and "powersgd" not in cls.composes_with:
                    refuse_powersgd(strategy, compression)
        for flag, size, what in (("--cp-size", self.cp_size, "each sequence"), ("--ep-size", self.ep_size, "experts")):
            uneven = [n for n in self.counts if n > 1 and size and n % size]
            if uneven:
                raise UsageError(
                    f"{flag} {size} splits {what} over that many processes, and --nproc has "
                    f"{', '.join(map(str, uneven))}; list process counts that are multiples of {size}."
                )
        for name in ("steps", "repeats"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be 1 or more (got {getattr(self, name)}).")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be 0 or more (got {self.warmup}).")


def run_cell(
    target: list[str], module: bool, n: int, strategy: str, config: BenchConfig, sync: bool, compression: str = "none"
) -> dict:
    """One run: rank 0's timed steps, every rank's peak memory and the gradient bytes it sends per step."""
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-") as tmp:
        # The cell's strategy replaces the script's, with no tensor or pipeline parallelism of the script's own.
        imposed = {"strategy": strategy, "tp_size": None, "pp_size": None, **config.values_for(EngineConfig)}
        if n == 1:  # the one-process baseline splits nothing
            imposed["cp_size"] = imposed["ep_size"] = None
        if reducing(strategy):  # the one-process baseline (single) and tp take no grad_compression
            imposed["grad_compression"] = compression
        spec = harness.Harness(tmp, imposed, warmup=config.warmup, steps=config.steps, grad_sync=sync)
        ranks = harness.run(target, module, n, spec, config.values_for(LaunchConfig))
    steps = harness.timed_steps(ranks[0], config.warmup)
    if not steps:
        raise UsageError(
            f"The script made {len(ranks[0]['steps'])} optimizer steps, none of them timed after {config.warmup} "
            "warm-up steps; give it more data or epochs, or lower --warmup."
        )
    return {
        "times": [s["time_s"] for s in steps],
        "samples": sum(s["samples"] for s in steps),
        "tokens": sum(s["tokens"] for s in steps),
        "memory": [r["peak_memory_bytes"] for r in ranks],
        "device": ranks[0]["device"],
        "precision": ranks[0]["precision"],
        # The ring's share of what each rank hands to the gradient collectives (harness.py); none on 1 process.
        "grad_bytes": _wire_bytes(ranks[0]["gradient_bytes"], strategy, n),
        "state_bytes": [r["optimizer_state_bytes"] for r in ranks],
        "state_elements": [r["optimizer_state_elements"] for r in ranks],
        "gathered_bytes": ranks[0]["optimizer_gathered_bytes"],
    }


def _wire_bytes(payload: int, strategy: str, n: int) -> float | None:
    """The ring's share of what a rank hands to the gradient collectives (harness.py); none on 1 process."""
    if not reducing(strategy) or n == 1:
        return None
    communication = strategy_class(strategy).facts.communication
    assert communication is not None  # reducing
    return payload * wire_factor(communication.gradients, n)


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(
    n: int, strategy: str, runs: list[dict], unsynced: list[dict], compression: str = "none"
) -> dict[str, Any]:
    times = [t for run in runs for t in run["times"]]
    seconds = [sum(run["times"]) for run in runs]
    cell: dict[str, Any] = {
        "nproc": n,
        "strategy": strategy,
        "grad_compression": compression if reducing(strategy) else "none",
        # Gradient bytes each rank sends per optimizer step (a ring's share of its payload; PowerSGD's after its
        # warm-up steps), or None where no gradients are reduced.
        "grad_bytes_sent": runs[0]["grad_bytes"],
        "repeats": len(runs),
        "step_time_s": {"median": statistics.median(times), "p90": float(np.percentile(times, 90))},
        "samples_per_s": spread([run["samples"] / s for run, s in zip(runs, seconds, strict=True)]),
        "tokens_per_s": None,
        "peak_memory_mb": [max(run["memory"][r] for run in runs) / 2**20 for r in range(n)],
        # The optimizer's states per rank, and per parameter element they are for (8.0: AdamW's two float32).
        "optimizer_state_mb": [b / 2**20 for b in runs[0]["state_bytes"]],
        "state_bytes_per_param": sum(runs[0]["state_bytes"]) / max(1, sum(runs[0]["state_elements"])),
        # What Muon all-gathers per step to orthogonalise whole matrices of shards (0: none, or not Muon).
        "optimizer_gather_mb": runs[0]["gathered_bytes"] / 2**20,
        "comm_share": None,
    }
    if all(run["tokens"] for run in runs):
        cell["tokens_per_s"] = spread([run["tokens"] / s for run, s in zip(runs, seconds, strict=True)])
    if unsynced:
        without = statistics.median([t for run in unsynced for t in run["times"]])
        cell["comm_share"] = max(0.0, 1.0 - without / cell["step_time_s"]["median"])
    return cell


def bench(config: BenchConfig, target: list[str], module: bool = False) -> dict[str, Any]:
    """Runs every cell and returns the report (also written to OUT/bench.json with the plots)."""
    cells, device, precision = [], None, None
    for n, strategy, compression in cell_list(config):
        runs = [run_cell(target, module, n, strategy, config, True, compression) for _ in range(config.repeats)]
        unsynced = []
        # tp communicates inside every layer's forward and backward, which no_sync leaves in place: the
        # gradient-sync share would read 0%, so it is not measured ("-").
        if config.comm_share and n > 1 and strategy_class(strategy).facts.reduces_gradients:
            unsynced = [
                run_cell(target, module, n, strategy, config, False, compression) for _ in range(config.repeats)
            ]
        cells.append(summarise(n, strategy, runs, unsynced, compression))
        device, precision = runs[0]["device"], runs[0]["precision"]
    for cell in cells:
        wanted = cell["strategy"] if config.baseline == "same" else plain()
        base = next((c for c in cells if c["nproc"] == 1 and c["strategy"] == wanted), None)
        if base is not None:
            cell["speedup"] = cell["samples_per_s"]["median"] / base["samples_per_s"]["median"]
            cell["efficiency"] = cell["speedup"] / cell["nproc"]
        else:
            cell["speedup"] = cell["efficiency"] = None
    report = {
        "target": " ".join(target),
        "device": device,
        "precision": precision,
        "config": {k: v for k, v in asdict(config).items()},
        "cells": cells,
    }
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    plot(report, out)
    return report


def cell_list(config: BenchConfig) -> list[tuple[int, str, str]]:
    """(processes, strategy, grad_compression) of every cell, in order: the one-process baseline once."""
    cells = []
    for n in config.counts:
        for strategy in [plain()] if n == 1 and config.baseline != "same" else config.strategy_names:
            reduces = reducing(strategy) and n > 1  # one process reduces nothing: compression changes nothing
            cells += [(n, strategy, c) for c in (config.compressions if reduces else ["none"])]
    return cells


def plot(report: dict[str, Any], out: Path) -> None:
    """speedup.png (with the ideal line) and memory.png (peak per rank, by strategy and process count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    baseline = plain()
    strategies = list(dict.fromkeys(label(c) for c in cells if c["strategy"] != baseline))
    counts = sorted({c["nproc"] for c in cells})
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(counts, counts, "k--", label="ideal")
    for strategy in strategies:
        points = [(c["nproc"], c["speedup"]) for c in cells if label(c) in (strategy, baseline) and c["speedup"]]
        axes.plot(*zip(*points, strict=True), "o-", label=strategy)
    axes.set(xlabel="processes", ylabel="speedup over 1 process", title=f"{report['device']}: speedup")
    axes.set_xticks(counts)
    axes.legend()
    figure.savefig(out / "speedup.png", dpi=120, bbox_inches="tight")
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    labels = [f"{label(c)}\n{c['nproc']}p" for c in cells]
    axes.bar(labels, [max(c["peak_memory_mb"]) for c in cells])
    axes.set(ylabel="peak memory per rank (MB, largest rank)", title=f"{report['device']}: memory per rank")
    figure.savefig(out / "memory.png", dpi=120, bbox_inches="tight")
    plt.close(figure)


def label(cell: dict[str, Any]) -> str:
    """The strategy, with its grad_compression where it has one: ddp, ddp+bf16."""
    compression = cell.get("grad_compression", "none")
    return cell["strategy"] if compression == "none" else f"{cell['strategy']}+{compression}"


def rate(value: float) -> str:
    """Thousands separators for large rates, three significant digits for small ones (a 135M model on CPU)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    tokens = any(c["tokens_per_s"] for c in report["cells"])
    cp = report["config"].get("cp_size")
    split = f"; each sequence over cp {cp} of the processes" if cp and cp > 1 else ""
    table = Table(title=f"bench on {report['device']} ({report['precision']}{split}): {report['target']}")
    columns = ["procs", "strategy", "samples/s (min/med/max)", *(["tokens/s"] if tokens else [])]
    columns += ["step ms med / p90", "speedup", "efficiency", "comm share", "grad MB sent/step", "peak MB per rank"]
    columns += ["optimizer MB per rank", "state B/param", "Muon gather MB/step"]
    for column in columns:
        table.add_column(column, justify="right")
    for c in report["cells"]:
        s = c["samples_per_s"]
        row = [str(c["nproc"]), label(c), " / ".join(rate(s[k]) for k in ("min", "median", "max"))]
        if tokens:
            row.append(rate(c["tokens_per_s"]["median"]) if c["tokens_per_s"] else "-")
        row += [
            f"{c['step_time_s']['median'] * 1e3:.1f} / {c['step_time_s']['p90'] * 1e3:.1f}",
            f"{c['speedup']:.2f}x" if c["speedup"] is not None else "-",
            f"{c['efficiency']:.0%}" if c["efficiency"] is not None else "-",
            f"{c['comm_share']:.0%}" if c["comm_share"] is not None else "-",
            f"{c['grad_bytes_sent'] / 2**20:,.3f}" if c.get("grad_bytes_sent") is not None else "-",
            " / ".join(f"{m:,.0f}" for m in c["peak_memory_mb"]),
            " / ".join(f"{m:,.1f}" for m in c["optimizer_state_mb"]),
            f"{c['state_bytes_per_param']:.2f}",
            f"{c['optimizer_gather_mb']:,.2f}",
        ]
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # files and pipes get the whole table unwrapped
        console = Console(width=160)
    console.print(table)


def run(config: BenchConfig, script: str | None, script_args: list[str], module: bool) -> None:
    """`multigpu bench`: SCRIPT or --recipe at every process count and strategy; prints and writes the report."""
    if (script is None) == (config.recipe is None):
        raise UsageError(
            "Give bench a SCRIPT or --recipe train|finetune (not both), or --collectives for the interconnect."
        )
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-recipe-") as scratch:
        if config.recipe is not None:
            target, module = [*RECIPES[config.recipe], "--save-dir", scratch, *script_args], True
        else:
            target = [script, *script_args]
        report = bench(config, target, module)
    print_report(report)
    print(f"wrote {Path(config.out) / 'bench.json'}, speedup.png and memory.png")
