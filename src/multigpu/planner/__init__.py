"""Memory per GPU for every strategy, before anything runs. Pure functions: no process group, no weights."""

from __future__ import annotations

from typing import Any, NamedTuple

from multigpu.core.errors import UsageError
from multigpu.planner.memory import OPTIMIZERS, Plan, PlanConfig, StrategyMemory
from multigpu.planner.module_shape import from_module
from multigpu.planner.recommend import plan_shape
from multigpu.planner.shapes import BUILTIN, ModelShape, load_shape

__all__ = [
    "BUILTIN",
    "OPTIMIZERS",
    "Choice",
    "ModelShape",
    "Plan",
    "PlanConfig",
    "StrategyMemory",
    "choose_strategy",
    "plan",
]


def plan(model: Any, sample_input: Any = None, **options: Any) -> Plan:
    """`model`: a built-in name, a config.json (or its directory), a ModelShape, or an nn.Module (with
    `sample_input`, one sample, its activations are measured by a traced forward and scaled by the batch size).

    `options` are PlanConfig's fields (gpus, nodes, gpu_memory such as "80GB", precision, optimizer, batch_size,
    seq_len, grad_accum_steps, unsharded_grad_accum, activation_checkpointing, lora_r, qlora, cpu_offload, tp_size,
    pp_size, cp_size, ep_size, cp_method, ...).
    """
    return plan_shape(_shape(model, sample_input), PlanConfig(**options))


def _shape(model: Any, sample_input: Any = None) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return load_shape(model)
    return from_module(model, sample_input)


def _built_on_meta(model: Any) -> bool:
    """A module built under engine.init_module() reaches engine.setup with its parameters on the meta device."""
    from multigpu.transforms.modules import on_meta  # torch, only when a module is given

    return hasattr(model, "parameters") and on_meta(model)


class Choice(NamedTuple):
    """What `auto` runs: a strategy, the ep degree it runs a mixture of experts at (1 for a dense model), and why."""

    strategy: str
    reason: str
    ep_size: int = 1


def choose_strategy(
    model: Any,
    optimizer: str,
    gpus: int,
    nodes: int,
    gpu_bytes: float,
    precision: str,
    offload_possible: bool,
    grad_accum_steps: int = 1,
    unsharded_grad_accum: bool = False,
    per: str = "GPU",
    ep_size: int | None = None,
) -> Choice:
    """`auto`: the fastest strategy whose model states and buffers fit (activations depend on the batch, unknown
    here, so leave room for them), and the reason, for the user. `per`: what `gpu_bytes` is the memory of, in the
    reason ("process" on CPU, where it is each process's share of the RAM). A mixture of experts (experts found by
    module_shape.expert_modules) without `ep_size` runs each strategy, fastest first, at the smallest ep degree that
    fits it (plan_shape's rule); with `ep_size`, at that degree.

    The choice is on training memory alone; the reason adds the setup warning where a model built whole would not
    fit the strategy's setup, unless `model` already lies on the meta device (built under engine.init_module()).
    """
    config = PlanConfig(
        gpus=gpus,
        nodes=nodes,
        gpu_memory=f"{gpu_bytes / 2**30}GiB",
        precision=precision,
        optimizer=optimizer,
        batch_size=1,
        seq_len=1,
        cpu_offload=offload_possible,
        grad_accum_steps=grad_accum_steps,
        unsharded_grad_accum=unsharded_grad_accum,
        ep_size=ep_size,
    )
    result = plan_shape(_shape(model), config, per)
    if result.recommendation is None:
        raise UsageError(f"No strategy fits this model: {result.reason}.")
    if result.setup_warning and not _built_on_meta(model):
        return Choice(result.recommendation, f"{result.reason}; {result.setup_warning}", result.ep_size)
    return Choice(result.recommendation, result.reason, result.ep_size)
