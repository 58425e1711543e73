"""The plan: every row's memory per GPU, and the recommendation, the fastest row that fits (the guides' decision
tree). For a mixture of experts whose ep is not asked for, zero3 is shown at every ep degree, and the recommendation
takes each strategy, fastest first, at the smallest ep that fits it. Pure arithmetic."""

from __future__ import annotations

from dataclasses import replace

from multigpu.config.optimizer import NOT_UNDER_DEEPSPEED, NOT_WITH_CPU_OFFLOAD
from multigpu.core.errors import UsageError
from multigpu.planner.gpus import MixedGpus, shares_that_fit
from multigpu.planner.memory import (
    FRAMEWORK_OVERHEAD,
    Plan,
    StrategyMemory,
    filled_row,
    model_parallel_name,
    row_ep,
    setup,
    strategy_memory,
)
from multigpu.planner.plan_config import PlanConfig, takes_ep
from multigpu.planner.rows import recommended_in, reference, rows, shown_in
from multigpu.planner.rows import row as row_of
from multigpu.planner.setup_memory import setup_fits, setup_warning
from multigpu.planner.shapes import ModelShape
from multigpu.planner.states import model_states
from multigpu.strategies.facts import BESIDE_MODEL_PARALLEL, DATA_PARALLEL, ONE_GPU


def plan_shape(shape: ModelShape, config: PlanConfig, per: str = "GPU") -> Plan:
    """`per`: what the memory is of, in the reasons ("GPU"; "process" for `auto` on CPU, where it is RAM)."""
    _, _, _, trainable = model_states(shape, config)
    plan = Plan(shape.name, shape.params, trainable, config, experts=shape.experts, active_params=shape.active_params)
    _check_tp_divides_heads(shape, config.tp_size)
    _check_ep(shape, config.ep_size)
    for name in _rows(config):
        plan.strategies.append(filled_row(name, shape, config))
        if name == reference() and shape.experts and config.world > 1:  # zero3 at every other ep, just below
            others = [ep for ep in ep_degrees(shape, config, name) if ep != row_ep(name, config)]
            plan.strategies += [filled_row(name, shape, replace(config, ep_size=ep)) for ep in others]
    plan.left_out = _left_out(config)
    candidates = _candidates(config)
    if config.mixed and not config.model_parallel and config.cp_size == 1:  # one GPU per data-parallel rank
        return recommend_mixed(plan, shape, config, per)
    fitting = [m for m in _ranked(shape, config, plan.strategies) if m.fits]
    allowed = [m for m in fitting if not row_of(m.strategy).offloads or config.cpu_offload]
    memory = f"{config.gpu_bytes / 2**30:.2f} GiB per {per}"
    # Where nothing fits, not even with offload, a sequence split over more GPUs may.
    split = _more_cp(shape, config) if not fitting else None
    if allowed or split:
        best, cp = (allowed[0], config.cp_size) if allowed else split
        if allowed and best not in plan.strategies:  # a strategy at an ep the table does not show: show it
            best = filled_row(best.strategy, shape, replace(config, ep_size=best.ep_size))
            after = max(i for i, m in enumerate(plan.strategies) if m.strategy == best.strategy)
            plan.strategies.insert(after + 1, best)
        plan.recommendation, plan.cp_size, plan.ep_size = best.strategy, cp, best.ep_size
        before = candidates[: candidates.index(best.strategy)]
        faster = ", ".join(dict.fromkeys(m.strategy for m in plan.strategies if m.strategy in before))
        split_further = f" with --cp-size {cp}" if cp != config.cp_size else ""
        at_ep = f" with --ep-size {best.ep_size}" if config.ep_size is None and best.ep_size > 1 else ""
        searched = " at any ep" if config.ep_size is None and shape.experts and config.world > 1 else ""
        plan.reason = f"{best.strategy} needs {best.total / 2**30:.2f} GiB of {memory}{split_further}{at_ep}" + (
            f"; {faster} would not fit{searched}" if faster else " and is the fastest choice"
        )
        if split_further:  # the sequence fits only split further over the GPUs
            plan.reason += f"; at --cp-size {config.cp_size} nothing fits {config.batch_size} x {config.seq_len} tokens"
        # The choice stays on training memory: whether the model is built whole is the user's choice, not the
        # config's, and the warning says how to build it when it matters.
        plan.setup_warning = setup_warning(best, config.gpu_bytes, config.precision, per)
        return plan
    instead = what_else(config, per)
    if fitting:  # an offloading row alone, which the config does not allow: the table says it fits, and so must this
        plan.reason = (
            f"only {fitting[0].strategy} fits {memory} at batch size {config.batch_size}, and it keeps the model "
            f"states in host memory ({fitting[0].cpu / 2**30:.2f} GiB per process): pass --cpu-offload to allow it, "
            f"or {instead}"
        )
    else:
        plan.reason = f"nothing fits {memory} at batch size {config.batch_size}: {instead}"
    return plan


def what_else(config: PlanConfig, per: str) -> str:
    """What may make a run fit that nothing fits: each change the command has not made already (a plan that has
    --activation-checkpointing full is not told to add it)."""
    lower = " or ".join(
        f"--{flag}" for flag, value in (("batch-size", config.batch_size), ("seq-len", config.seq_len)) if value > 1
    )
    changes = [f"lower {lower}"] if lower else []
    if config.activation_checkpointing not in ("full", "offload"):  # offload keeps less on the GPU than full
        changes.append("add --activation-checkpointing full")
    splits = [("tp", config.tp_size), ("pp", config.pp_size), ("cp", config.cp_size)]
    added = "/".join(f"--{name}-size" for name, size in splits if size == 1)
    raised = "/".join(f"--{name}-size" for name, size in splits if size > 1)
    changes.append(f"more {'GPUs' if per == 'GPU' else 'machines'}" + (f" or {added}" if added else ""))
    changes += [f"a larger {raised}"] if raised else []
    if config.lora_r is None:
        changes.append("LoRA/QLoRA")
    elif not config.qlora:
        changes.append("QLoRA (--qlora)")
    return ", ".join(changes)


def ep_degrees(shape: ModelShape, config: PlanConfig, name: str) -> list[int]:
    """The ep degrees a row's strategy can run a mixture at, smallest first: those that divide both its experts and
    the processes its ep groups are drawn from (config/layout.py's expert_pool)."""
    pool, _ = replace(config, ep_size=None).layout(name).expert_pool
    return [ep for ep in range(1, pool + 1) if pool % ep == 0 and shape.experts % ep == 0]


def _ranked(shape: ModelShape, config: PlanConfig, shown: list[StrategyMemory]) -> list[StrategyMemory]:
    """The rows a recommendation is drawn from, in its order: the candidates fastest first, and for a mixture
    whose ep is not asked for, each strategy that takes ep at every degree, smallest first (rows the table does
    not show are computed here)."""
    ranked = []
    for name in _candidates(config):
        search = config.ep_size is None and shape.experts and takes_ep(name) and config.world > 1
        for ep in ep_degrees(shape, config, name) if search else [row_ep(name, config)]:
            row = next((m for m in shown if m.strategy == name and m.ep_size == ep), None)
            ranked.append(row or strategy_memory(name, shape, replace(config, ep_size=ep), config.batch_size))
    return ranked


def _check_ep(shape: ModelShape, ep: int | None) -> None:
    if ep is None or ep == 1:
        return
    if not shape.experts:
        raise UsageError(f"--ep-size {ep} spreads a mixture's experts, but {shape.name} has none; drop --ep-size.")
    if shape.experts % ep:
        raise UsageError(
            f"--ep-size {ep} does not divide {shape.name}'s {shape.experts} experts per layer; choose an ep size "
            f"that divides {shape.experts}."
        )


def _candidates(config: PlanConfig) -> tuple[str, ...]:
    """The rows a recommendation is drawn from. One GPU: single unless only offload fits; several: the guides'
    order, fastest first."""
    if config.world == 1:
        candidates = recommended_in(ONE_GPU)
    else:
        candidates = _rows(config) if config.model_parallel else recommended_in(DATA_PARALLEL)
    return tuple(name for name in candidates if name not in _refused_names(config))


def _more_cp(shape: ModelShape, config: PlanConfig) -> tuple[StrategyMemory, int] | None:
    """Where nothing fits a transformer's sequence: the fastest row under the smallest larger cp degree (twice,
    four times, ... the one asked) that fits without offload, with that degree; None where none does."""
    if shape.transformer is None or config.world == 1:
        return None
    cp = 2 * config.cp_size
    while config.world % (config.tp_size * config.pp_size * cp) == 0 and config.seq_len % (2 * cp) == 0:
        split = replace(config, cp_size=cp)
        rows = [strategy_memory(name, shape, split, split.batch_size) for name in _rows(split)]
        allowed = [m for m in rows if m.strategy in _candidates(split) and m.fits and not row_of(m.strategy).offloads]
        if allowed:
            best = allowed[0]
            best.setup, best.setup_init_module = setup(best.strategy, shape, split, best.pp_rank)
            best.setup_fits = setup_fits(best, split.gpu_bytes, FRAMEWORK_OVERHEAD)
            return best, cp
        cp *= 2
    return None


def _rows(config: PlanConfig) -> tuple[str, ...]:
    """The plan's rows: the layout's, less those a run of this optimizer refuses."""
    return tuple(name for name in _layout_rows(config) if name not in _refused_names(config))


def _refused_names(config: PlanConfig) -> set[str]:
    return {name for names, _ in _refused_rows(config) for name in names}


def _refused_rows(config: PlanConfig) -> list[tuple[tuple[str, ...], str]]:
    """(rows, why) for each kind of row a run under this optimizer refuses (config/optimizer.py says which)."""
    refused = []
    if config.optimizer in NOT_UNDER_DEEPSPEED:
        flat = tuple(label for label, r in rows().items() if r.facts.flat_partitions)
        refused.append((flat, f"DeepSpeed steps flat partitions of many parameters, which {config.optimizer} cannot"))
    if config.optimizer in NOT_WITH_CPU_OFFLOAD:
        offloading = tuple(label for label, r in rows().items() if r.offloads)
        why = f"{config.optimizer} gathers each matrix's update, which offload keeps on the host"
        refused.append((offloading, why))
    return refused


def _left_out(config: PlanConfig) -> str:
    """The rows the plan does not show, and why (Plan.left_out)."""
    notes = []
    if (config.cp_size > 1 or (config.ep_size or 1) > 1) and not config.model_parallel:
        own = [label for label in shown_in(DATA_PARALLEL) if label not in recommended_in(DATA_PARALLEL)]
        notes.append(f"{', '.join(own)}: DeepSpeed lays out its own process groups, without --cp-size or --ep-size")
    laid_out = _layout_rows(config)
    for names, why in _refused_rows(config):
        if shown := [name for name in names if name in laid_out]:
            notes.append(f"{', '.join(shown)}: {why}")
    return "; ".join(notes)


def _layout_rows(config: PlanConfig) -> tuple[str, ...]:
    if not config.model_parallel:
        if config.cp_size > 1 or (config.ep_size or 1) > 1:
            return recommended_in(DATA_PARALLEL)  # DeepSpeed's rows take no cp and no ep (Plan.left_out)
        return shown_in(ONE_GPU) if config.world == 1 else shown_in(DATA_PARALLEL)
    if config.data_parallel == 1 and config.cp_size == 1:
        return (model_parallel_name(config),)
    # hsdp is a row of its own only where it replicates; with one node's worth of shards it is zero3.
    composed = shown_in(BESIDE_MODEL_PARALLEL)
    return tuple(n for n in composed if not row_of(n).memory.shards_within_replica or config.layout(n).replicate > 1)


def _check_tp_divides_heads(shape: ModelShape, tp: int) -> None:
    t = shape.transformer
    if t is None or tp == 1:
        return
    for count, what in ((t.heads, "attention heads"), (t.kv_heads, "key/value heads")):
        if count % tp:
            raise UsageError(f"--tp-size {tp} does not divide the model's {count} {what}; choose one that does.")


def recommend_mixed(plan: Plan, shape: ModelShape, config: PlanConfig, per: str) -> Plan:
    """A node of different GPUs: the fastest strategy whose global batch the GPUs hold split by batch shares (the
    even split among them, where the smallest GPU holds it): the states are the same on every GPU, and the slices
    move only the activations."""
    for row in _ranked(shape, config, plan.strategies):
        if row_of(row.strategy).offloads and not config.cpu_offload:
            continue
        mixed = mixed_gpus(shape, config, row.strategy)
        if mixed.slices is None:
            continue
        plan.recommendation, plan.ep_size, plan.mixed = row.strategy, row.ep_size, mixed
        split = "even shares fit every GPU" if row.fits else "only shares that give the smaller GPUs less fit"
        plan.reason = f"{row.strategy} holds the global batch of {mixed.global_batch} on these GPUs; {split}"
        plan.setup_warning = setup_warning(row, config.gpu_bytes, config.precision, per)
        return plan
    plan.reason = f"no shares of the global batch of {config.batch_size * config.world} fit: {what_else(config, per)}"
    return plan


def mixed_gpus(shape: ModelShape, config: PlanConfig, strategy: str) -> MixedGpus:
    """Under `strategy`, the largest batch each of a node's GPUs holds (its own plan at its memory, the states
    sharded over the same GPUs), and each GPU's slice of the global batch (--batch-size x the GPUs): by speed where
    every GPU's peak is known, else by what each holds, within what each holds."""
    gpus = config.node_gpus * config.nodes
    most = {}
    for memory in {gpu.memory for gpu in gpus}:
        alike = replace(config, gpus=str(len(config.node_gpus)), gpu_memory=f"{memory / 2**30}GiB")
        most[memory] = next(m for m in plan_shape(shape, alike).strategies if m.strategy == strategy).max_batch_size
    holds = [most[gpu.memory] for gpu in gpus]
    known = all(gpu.tflops for gpu in gpus)
    speeds = [gpu.tflops or 0.0 for gpu in gpus] if known else [float(n) for n in holds]
    total = config.batch_size * len(gpus)
    slices = shares_that_fit(holds, speeds, total)
    return MixedGpus([gpu.label for gpu in gpus], holds, slices, total, "speed" if known else "memory")
