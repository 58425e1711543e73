"""The order in which engine.setup transforms a model, for every strategy: `parallelize`, one function to read whole.

Liger kernels -> float8 -> tensor (and sequence) parallelism -> context-parallel attention -> expert parallelism ->
activation checkpointing -> compile -> pipeline stages -> expert data parallelism -> data-parallel wrapping (the
strategy's DDP, FSDP2 units, ZeRO-1, DeepSpeed or zero inside the stages). torchtitan's parallelize_llama runs the same
order (tp, float8's tp styles, checkpointing, compile, FSDP), float8 converted before it. Each step's place, and why,
is said beside it; docs/architecture.md lists them.

A strategy gives the plan its mesh (built first: tp, cp and ep lay their tensors out on it), its precision plan,
`make_alike` (where the model waits for tp and ep, and whether every rank takes rank 0's weights first), the facts
each step asks of it (strategies/base.py: splits_layers, unit_blocks, expert_sharding, ...), a pipeline's
`cut_stages` and its wrapping (`setup`, or `setup_from_meta` for a model still on the meta device that it shards as
the values arrive). It keeps nothing of the run that this plan finds: the mixture of experts is returned.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from multigpu.config.precision import PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.engine.model_values import Build, meta_values
from multigpu.parallel.context import ContextParallel
from multigpu.parallel.context_attention import use_context_attention
from multigpu.parallel.experts import MixtureOfExperts, mixture_of_experts
from multigpu.strategies import Strategy
from multigpu.transforms.compile import compile_blocks
from multigpu.transforms.float8 import convert_linears
from multigpu.transforms.loss import apply_liger
from multigpu.transforms.modules import MetaValues, outermost, repointing
from multigpu.transforms.recompute import recompute_blocks


def parallelize(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    env: DistEnv,
    plan: PrecisionPlan,
    config: EngineConfig,
    build: Build,
    say: Callable[[str], None],
    cp: ContextParallel | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None, MixtureOfExperts | None]:
    """The model and optimizer set up for `strategy`, from a plain build or one on the meta device (init_module),
    and the model's mixture of experts (None for a dense model): `build` is where the random stream stood when that
    build began, and the checkpoint load_pretrained gave it; `cp`, the context parallelism whose attention the
    model's takes."""
    mesh = strategy.build_mesh(env)  # first: tp, cp and ep lay their tensors out on the strategy's mesh
    if config.liger:  # Liger first: it swaps whole modules, which every later step must see as they will run
        apply_liger(model)
    # The mixture found on the model as built: tp's plan leaves its experts out, ep spreads them, pp weighs them.
    experts = mixture_of_experts(model, strategy.layout, env.device.type)
    values = meta_values(strategy, model, optimizer, env, *build, say)  # a meta build gets its values here, or sharded
    model = batchnorm(model, strategy, env, config.sync_batchnorm)  # SyncBatchNorm keeps the Parameters: any time
    # float8 before tp, as torchtitan converts before parallelizing: tp splits float8 layers, recomputation and
    # compile see them, and the sharding strategies all-gather tensorwise weights in float8.
    said = convert_linears(model, optimizer, config.float8, env.device, all_gather=strategy.gathers_weights())
    if said:
        say(said)
    if plan.params != torch.float32:  # bf16-true, before tp splits and ranks exchange weights: half the bytes
        model.to(plan.params)  # on the meta device, free: the values are cast as they arrive
    # A model that holds its values; not one a strategy shards from the meta device (no tp, no ep there).
    holds_values = values is None
    alike = holds_values and strategy.make_alike(model, env)  # tp's and ep's slices are cut from rank 0's weights
    if holds_values and strategy.splits_layers():
        # tp before cp, ep, recomputation and compile: each of them runs on the split layers and their collectives.
        split_layers(model, optimizer, strategy)
    if cp is not None:  # cp after tp: Ulysses spreads over the cp ranks the heads that tp left this rank
        cp.join(mesh)
        use_context_attention(model, cp)
    if holds_values and strategy.layout.ep > 1:  # ep after tp, which left the experts whole; before what runs them
        spread_experts(model, optimizer, experts, env, alike)
    # Checkpointing after the model-parallel steps: a recomputed block runs their collectives again (selective keeps
    # their outputs). It wraps the blocks the strategy shards, so FSDP's hooks run around the recomputation.
    blocks = checkpointed_blocks(model, strategy, config.activation_checkpointing)
    recompute_blocks(model, blocks, config.activation_checkpointing)
    # compile after tp and checkpointing, as torchtitan orders them: dynamo traces each block as it will run, its
    # DTensors and collectives included; before the wrapping, whose hooks (FSDP's) dynamo then leaves out.
    if config.compile:
        compile_blocks(model, blocks, config.compile_backend, static=static_shapes(strategy))
    # A pipeline's stages cut after compile (each rank keeps its own, the rest goes to the meta device): tp, ep,
    # recomputation and compile ran on the whole model, and the stages take their slices; pp only.
    model, optimizer = strategy.cut_stages(model, optimizer, env)
    if holds_values and strategy.layout.ep > 1:  # after the cut: each rank holds only its stages' experts
        hold_experts(model, optimizer, experts, strategy, plan)
    # The data-parallel wrapping last: DDP's buckets and FSDP's units take the parameters every step above left.
    model, optimizer = wrap(model, optimizer, strategy, env, plan, values, say)
    return model, optimizer, experts


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy,
    env: DistEnv,
    plan: PrecisionPlan,
    values: MetaValues | None,
    say: Callable[[str], None],
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Data-parallel wrapping: the strategy's setup, or for a model still on the meta device its setup_from_meta,
    which shards it as the `values` arrive (and says what a pretrained checkpoint filled)."""
    if values is None:
        return strategy.setup(model, optimizer, env, plan)
    model, optimizer = strategy.setup_from_meta(model, optimizer, env, plan, values)
    if values.read is not None:
        say(values.read.summary(values.initialised))
    return model, optimizer


def split_layers(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy) -> None:
    """Tensor parallelism: the model's planned layers split over the strategy's tp dimension, in place, the
    optimizer pointed at the split weights. A pipeline splits the whole model, then cuts its stages from it."""
    # Imported by runs with tp only: the CLI's process imports this module, and DTensor's import costs it ~0.5 s.
    from multigpu.parallel.tensor_parallel import tensor_parallelize

    with repointing(optimizer, model):
        tensor_parallelize(model, strategy.mesh["tp"], strategy.splits_sequence())


def spread_experts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    experts: MixtureOfExperts | None,
    env: DistEnv,
    alike: bool,
) -> None:
    """Expert parallelism: each rank's 1/ep of every mixture layer's experts, tokens dispatched to them; the
    optimizer pointed at the spread weights. hold_experts then readies them for the strategy's wrapping. `alike`:
    the ranks hold rank 0's weights already (else ep broadcasts them)."""
    from multigpu.parallel.expert_parallel import parallelize as spread  # imported by runs with ep only

    assert experts is not None  # mixture_of_experts refuses ep for a model without a mixture
    with repointing(optimizer, model):
        spread(experts, env.device, alike=alike)


def hold_experts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    experts: MixtureOfExperts | None,
    strategy: Strategy,
    plan: PrecisionPlan,
) -> None:
    """Expert data parallelism, ep's last step: the ranks that hold the same experts keep them alike, as the
    strategy's wrapping needs (its expert_sharding): each layer's experts an FSDP unit over them, or replicas whose
    gradients a hook averages; the optimizer pointed at what the units replaced. Nothing may move the model after
    it (a move swaps the experts' DTensors, and their hooks with them)."""
    from multigpu.parallel.expert_parallel import hold_experts as hold  # imported by runs with ep only

    assert experts is not None  # mixture_of_experts refuses ep for a model without a mixture
    with repointing(optimizer, model):
        hold(experts, strategy.expert_sharding(plan))


def static_shapes(strategy: Strategy) -> bool:
    """Whether compiled blocks keep static shapes: where zero2, zero3 or hsdp shard tp's split layers (alone or in
    a pipeline's stages). There, torch 2.13's tracing of a block whose batch dimension a changed shape made dynamic
    recurses without end (the ranks of the second data-parallel group); each new shape compiles once more instead."""
    return strategy.layout.tp > 1 and strategy.gathers_weights()


def checkpointed_blocks(model: nn.Module, strategy: Strategy, mode: str) -> list[nn.Module]:
    """The blocks recomputation and compile take: those a sharding strategy wraps (its units, outermost), or the
    model's own. Refuses selective where the strategy shards modules inside a block."""
    units, sharded = strategy.unit_blocks(model), strategy.sharded_modules(model)
    if mode == "selective" and len(outermost(sharded)) < len(sharded):
        raise UsageError(
            f"activation_checkpointing selective cannot run where {strategy.name} shards modules inside each block "
            "(4-bit layers, nested blocks): their FSDP hooks run other ops when a block is recomputed, which torch's "
            "selective checkpointing refuses; use full or offload."
        )
    return outermost(units)


def batchnorm(model: nn.Module, strategy: Strategy, env: DistEnv, sync: bool) -> nn.Module:
    """BatchNorm turned into SyncBatchNorm when asked, else a warning where processes or replicas normalise
    alone. A warning, not engine.print: a run that wants per-process statistics can filter it out."""
    layers = sum(isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    if not layers:
        return model
    if sync and strategy.needs_process_group:
        # Keeps the Parameter objects, so an optimizer built before setup stays valid.
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if strategy.spread.gpus_in_process:  # dp: a replica on each of the process's GPUs
        parts = f"each of the {torch.cuda.device_count()} GPUs' slices of a batch under dp with that slice's"
        remedy = "use strategy ddp with sync_batchnorm=True (--sync-batchnorm) to synchronise them"
    elif strategy.needs_process_group and env.world_size > 1:
        parts = f"each of the {env.world_size} processes' batches under {strategy.name} with that process's"
        remedy = "pass sync_batchnorm=True (--sync-batchnorm) to synchronise them"
        if env.device.type != "cuda":
            remedy = "sync_batchnorm=True (--sync-batchnorm) synchronises them when training on GPUs"
    else:
        return model
    if env.rank == 0:  # one warning per run, not one per rank
        warnings.warn(
            f"The model's {layers} BatchNorm layer(s) normalise {parts} own statistics rather than the global "
            f"batch's (running statistics included); {remedy}.",
            stacklevel=3,
        )
    return model
