"""A Plan for people (a rich table) and for programs (JSON)."""

from __future__ import annotations

import json
import sys

from multigpu.planner.memory import Plan, StrategyMemory
from multigpu.planner.setup_memory import FITS, NO, WITH_INIT_MODULE


def gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def fits(m: StrategyMemory) -> str:
    """Training and setup together: a strategy whose training fits may still need engine.init_module() to start."""
    if not m.fits:
        return "no"
    return {FITS: "yes", WITH_INIT_MODULE: "init_module", NO: "no (setup)"}[m.setup_fits]


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2)


def layout(plan: Plan) -> str:
    """The model-parallel layout for the title; empty without one."""
    c = plan.config
    cp = f"; cp {c.cp_size} ({c.cp_method})" if c.cp_size > 1 else ""
    if not c.model_parallel:
        return cp
    parts = [f"tp {c.tp_size}{' (sequence parallel)' if c.sequence_parallel else ''}"] if c.tp_size > 1 else []
    if c.pp_size > 1:
        chunks = f", {c.pp_stages_per_rank} stages per rank" if c.pp_stages_per_rank > 1 else ""
        parts.append(f"pp {c.pp_size} ({c.pp_schedule}, {c.microbatches} micro-batches{chunks})")
    return f"; {' x '.join(parts)}, data parallel {c.data_parallel}{cp}"


#: The table's columns after the strategy (and ep, where experts are): GiB per GPU, setup, fit and the limits.
COLUMNS = ("params", "grads", "optimizer", "activations", "temporary", "overhead", "total", "setup", "init_module",
           "fits", "max batch", "max seq", "cpu")  # fmt: skip


def title(plan: Plan) -> str:
    """The model, the hardware and the training setup the table is for."""
    c = plan.config
    checkpointing = "" if c.activation_checkpointing == "none" else f", {c.activation_checkpointing} checkpointing"
    active = f", {plan.active_params / 1e9:.3g}B active in {plan.experts} experts" if plan.experts else ""
    return (
        f"{plan.model}: {plan.params / 1e9:.3g}B parameters ({plan.trainable / 1e6:,.1f}M trainable{active}), "
        f"{c.world} GPU(s) of {c.gpu_bytes / 2**30:.0f} GiB{' (the smallest)' if c.mixed else ''}, {c.precision}, "
        f"{c.optimizer}, "
        f"batch {c.batch_size} x {c.seq_len} tokens{checkpointing}" + layout(plan)
    )


def row(m: StrategyMemory, experts: bool) -> tuple[str, ...]:
    """One strategy's cells, in the order of its columns."""
    return (
        m.strategy,
        *((str(m.ep_size),) if experts else ()),
        *(gib(value) for value in (m.params, m.grads, m.optimizer, m.activations, m.temporary, m.overhead)),
        gib(m.total),
        gib(m.setup),
        gib(m.setup_init_module) if m.setup_init_module != m.setup else "",
        fits(m),
        str(m.max_batch_size),
        f"{m.max_seq_len:,}" if m.max_seq_len else "",
        gib(m.cpu) if m.cpu else "",
    )


def print_table(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    experts = bool(plan.experts) or any(m.ep_size > 1 for m in plan.strategies)
    table = Table(
        title=title(plan),
        caption="GiB per GPU (cpu: host memory per process). setup: a rank's tensors while the model is built whole, "
        "init_module: under engine.init_module() (blank: the same); zero3+offload sets up in host memory. "
        "max seq: the longest sequence that fits at batch size 1"
        + ("; ep: the experts split over ep ranks, each slice sharded over the rest" if experts else ""),
    )
    for column in ("strategy", *(("ep",) if experts else ()), *COLUMNS):
        table.add_column(column, justify="right")
    for m in plan.strategies:
        table.add_row(*row(m, experts))
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log or a pipe gets the whole table
    console.print(table)
    for line in notes(plan):
        console.print(line)


def notes(plan: Plan) -> list[str]:
    """What the table leaves unsaid: the pipeline rank shown, what was not estimated or left out, and the
    recommendation."""
    c, lines = plan.config, []
    if c.pp_size > 1:
        ranks = ", ".join(f"{m.strategy} {m.pp_rank}" for m in plan.strategies)
        lines.append(f"pipeline rank shown (the one whose total binds): {ranks}")
    if not any(m.activations for m in plan.strategies):
        lines.append(
            "activations not estimated: give --model (or --layers --hidden --heads --vocab with --params), "
            "or call multigpu.plan(module, sample_input=...) to measure them"
        )
    if plan.left_out:
        lines.append(f"left out: {plan.left_out}")
    cp = f" with --cp-size {plan.cp_size}" if plan.recommendation and plan.cp_size != c.cp_size else ""
    cp += f" with --ep-size {plan.ep_size}" if plan.recommendation and plan.ep_size != (c.ep_size or 1) else ""
    lines.append(f"recommendation: {plan.recommendation or 'none'}{cp} ({plan.reason})")
    if plan.setup_warning:
        lines.append(f"warning: {plan.setup_warning}")
    return lines + mixed_notes(plan)


def mixed_notes(plan: Plan) -> list[str]:
    """A node of different GPUs: what each holds under the recommendation, and the batch shares that fit."""
    c, mixed = plan.config, plan.mixed
    if not c.mixed:
        return []
    kinds = [
        f"{c.node_gpus.count(gpu)} x {gpu.label}" + (f" ({gpu.tflops:g} TFLOPS)" if gpu.tflops else "")
        for gpu in dict.fromkeys(c.node_gpus)
    ]
    lines = [", ".join(kinds) + " per node: the table is for the smallest"]
    if mixed is None:
        grouped = c.model_parallel or c.cp_size > 1
        why = "under tp, pp or cp the smallest GPU alone is planned" if grouped else "no split of the batch fits"
        return [*lines, f"batch shares: none ({why})"]
    holds = dict(zip(mixed.gpus, mixed.most, strict=True))
    lines.append(
        f"under {plan.recommendation} each GPU holds at most "
        + ", ".join(f"{label} {most}" for label, most in holds.items())
        + f" sequences of {c.seq_len} tokens"
    )
    slices = ",".join(map(str, mixed.slices or ()))
    lines.append(
        f"batch shares by {mixed.by} within memory: --batch-shares {slices} (the global batch of "
        f"{mixed.global_batch}, {c.batch_size} per GPU when even)"
    )
    return lines
