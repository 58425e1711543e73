"""How an Engine starts: the strategy that runs (the config's, or the planner's pick for `auto` once engine.setup
sees the model), the process group it joins, the seeds, and what becomes of the model's BatchNorm layers."""

from __future__ import annotations

import contextlib
import copy
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from multigpu.config.layout import ParallelDims, resolve_layout
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.config.settings import strategy_option_fields
from multigpu.core.env import DistEnv, check_backend, init_process_group
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.engine.trackers import check_servers, parse_log_to
from multigpu.models.compile import compile_blocks
from multigpu.models.float8 import check_float8, convert_linears
from multigpu.models.loss import apply_liger
from multigpu.models.loss import check_runnable as check_loss
from multigpu.models.modules import (
    MetaValues,
    default_units,
    materialize,
    on_meta,
    outermost,
    parameters_on_meta,
    repoint,
)
from multigpu.models.pretrained import SafetensorsCheckpoint
from multigpu.models.recompute import recompute_blocks
from multigpu.parallel.context import ContextParallel
from multigpu.parallel.context_attention import use_context_attention
from multigpu.parallel.experts import mixture_of_experts
from multigpu.planner import choose_strategy
from multigpu.strategies import Strategy, build_strategy
from multigpu.strategies.dp import DataParallel
from multigpu.strategies.fsdp import quantized_owners


def resolve(given: str | Strategy, env: DistEnv, config: EngineConfig, say: Callable[[str], None]) -> Strategy:
    """The strategy `config` names, built for `env`'s processes, or one sentence refusing it. `given` is what the
    script passed: a configured Strategy keeps its options (its layout resolved for the processes launched, unless
    it was built with one), unless an observer's configure renamed the strategy."""
    nodes = max(1, env.world_size // env.local_world_size)
    if isinstance(given, Strategy) and given.name == config.strategy:
        if given.layout.world_size == env.world_size:
            return given
        return replace(given, layout=resolve_layout(config, given.spread, env.world_size, nodes, given.name))
    if config.strategy != "auto":
        return build_strategy(config.strategy, config, env.world_size, nodes, say)
    if (config.tp_size or 1) > 1 or (config.pp_size or 1) > 1:
        raise UsageError(
            "Strategy auto does not choose tensor or pipeline parallelism; name the strategy to run them with (tp, "
            "pp, zero2, zero3 or hsdp) beside tp_size and pp_size."
        )
    if env.is_distributed:  # ddp joins the process group now; Engine.setup asks the planner once it sees the model
        # (strategy_for), which takes the strategy options auto may use, such as cpu_offload: ddp takes none of them.
        options = {option.name: option.default for _, option in strategy_option_fields()}
        return build_strategy("ddp", replace(config, **options), env.world_size, nodes, say)
    say("strategy auto -> single (1 process)")
    return build_strategy("single", config, env.world_size, nodes, say)


def precision_plan(strategy: Strategy, config: EngineConfig, env: DistEnv) -> PrecisionPlan:
    """What the run's precision means under `strategy`, once everything the strategy and the settings cannot run on
    this device has been refused."""
    plan = strategy.precision_plan(Precision(config.precision), env.device)
    strategy.check_runnable(env.device, plan)
    check_float8(config.float8, env.device)
    if config.sync_batchnorm and isinstance(strategy, DataParallel):
        raise UsageError(
            "sync_batchnorm needs one process per GPU and strategy dp drives every GPU from one process; "
            "use strategy ddp (multigpu run -n N) or drop sync_batchnorm."
        )
    changed = [name for name in ("compile", "activation_checkpointing") if getattr(config, name) not in (False, "none")]
    if changed and isinstance(strategy, DataParallel):
        raise UsageError(
            f"{' and '.join(changed)} cannot run under strategy dp: nn.DataParallel copies the model to each GPU in "
            "every step, and the copies would run the original blocks' forward on the first GPU; use strategy ddp."
        )
    if config.compile and strategy.layout.tp > 1:
        raise UsageError(
            "compile cannot run with tensor parallelism on torch 2.13: a compiled block's backward hands DTensor's "
            "redistribution a plain tensor and fails in the first step; drop --compile, or the tensor parallelism."
        )
    if strategy.layout.cp > 1 and config.cp_method == "ring" and env.device.type != "cuda":
        raise UsageError(
            "cp_method ring runs torch's ring attention, which needs CUDA GPUs; use cp_method ulysses (the default) "
            "on this machine."
        )
    find_unused = getattr(strategy, "find_unused_parameters", False)
    check_loss(config.loss, config.liger, env.device, strategy.name, strategy.layout.tp > 1, find_unused)
    if config.sync_batchnorm and strategy.needs_process_group and env.device.type != "cuda":
        raise UsageError(
            "sync_batchnorm synchronises BatchNorm between GPUs, and torch's SyncBatchNorm refuses to run on CPU; "
            "drop sync_batchnorm (--sync-batchnorm) or run on GPUs."
        )
    return plan


def context_parallel(strategy: Strategy, config: EngineConfig) -> ContextParallel | None:
    """The run's context parallelism (its group joined at setup), or None without cp_size."""
    if strategy.layout.cp == 1:
        return None
    return ContextParallel(None, strategy.layout.cp, 0, config.cp_method)


def check(config: EngineConfig, nproc: int) -> ParallelDims:
    """Refuses, before any process starts, what the Engine would refuse in each of `nproc` workers; the layout they
    will run, for the checks of the model against it."""
    env = DistEnv(world_size=nproc, local_world_size=nproc)
    strategy = resolve(config.strategy, env, config, lambda _: None)
    precision_plan(strategy, config, env)
    if config.backend is not None:
        check_backend(config.backend, env.device)
    if config.log_dir is not None:  # the main worker would refuse it after the launch, and the others wait meanwhile
        check_servers(parse_log_to(config.log_to, config.log_dir))
    return strategy.layout


def join(env: DistEnv, strategy: Strategy, config: EngineConfig) -> None:
    """Joins the process group the strategy needs, then seeds every generator the same on every rank, so that
    models built afterwards start identical everywhere."""
    if strategy.needs_process_group:
        backend = config.backend or env.default_backend()
        init_process_group(env, backend, timedelta(seconds=config.timeout_s))
    elif config.backend is not None:
        check_backend(config.backend, env.device)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    random.seed(config.seed)


def strategy_for(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    env: DistEnv,
    config: EngineConfig,
    say: Callable[[str], None],
) -> Strategy:
    """`auto` with several processes: the planner's fastest strategy that fits this device's memory (for a mixture
    of experts without ep_size, at the smallest ep degree that fits it)."""
    if env.device.type == "cuda":
        memory = torch.cuda.get_device_properties(env.device).total_memory
    else:  # the processes of a node share its RAM
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / env.local_world_size
    kind = "sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw"  # others counted as Adam (2 states)
    name, reason, ep_size = choose_strategy(
        model,
        kind,
        gpus=env.local_world_size,
        nodes=max(1, env.world_size // env.local_world_size),
        gpu_bytes=memory,
        precision=config.precision,
        offload_possible=env.device.type == "cuda",
        grad_accum_steps=config.grad_accum_steps,
        unsharded_grad_accum=config.unsharded_grad_accum,
        per="GPU" if env.device.type == "cuda" else "process",
        ep_size=config.ep_size,
    )
    say(f"strategy auto -> {name}: {reason}")
    offload = name == "zero3+offload"
    chosen = replace(
        config,
        strategy="zero3" if offload else name,
        cpu_offload=offload,
        unsharded_grad_accum=name.startswith(("zero2", "zero3")) and config.unsharded_grad_accum,
        ep_size=ep_size if ep_size > 1 else config.ep_size,  # a mixture that fits only with its experts split
    )
    return resolve(chosen.strategy, env, chosen, say)


def build_context(
    strategy: Strategy, meta: bool | None, auto_pending: bool, env: DistEnv, plan: PrecisionPlan
) -> contextlib.AbstractContextManager:
    """What engine.init_module builds inside: parameters on the meta device when asked (meta=True) or while the
    strategy is undecided (auto decides at setup), nothing special when asked not to, else the strategy's own."""
    if meta or (meta is None and auto_pending):
        return parameters_on_meta()
    return strategy.build_context(env, plan) if meta is None else contextlib.nullcontext()


def check_loadable(model: nn.Module, read: SafetensorsCheckpoint) -> None:
    """Refuses, before any value is read, a model the checkpoint cannot fill: one already partitioned, or one
    whose tensors have other shapes than the stored ones of the same names."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise UsageError(
            "A model built in DeepSpeed's zero.Init is already partitioned; build it under "
            "engine.init_module(meta=True) to load pretrained weights into it."
        )
    shapes = {name: tensor.shape for name, tensor in model.state_dict(keep_vars=True).items()}
    read.check_fits(shapes, "in the model", "load the checkpoint saved from this model, or build the model it fits")


def load_whole(model: nn.Module, read: SafetensorsCheckpoint) -> list[str]:
    """Copies the checkpoint into a model that holds all its weights (check_loadable's), a tensor at a time;
    returns the names it does not hold (left as built)."""
    kept = []
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            value = read(name)
            if value is None:
                kept.append(name)
            else:
                tensor.copy_(value)
    return kept


def set_up(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    env: DistEnv,
    plan: PrecisionPlan,
    config: EngineConfig,
    build: tuple[torch.Tensor | None, SafetensorsCheckpoint | None],
    say: Callable[[str], None],
    cp: ContextParallel | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The model and optimizer set up for `strategy`, from a plain build or one on the meta device (init_module):
    `build` is where the random stream stood when that build began, and the checkpoint load_pretrained gave it;
    `cp`, the context parallelism whose attention the model's takes."""
    if config.liger:  # before anything wraps, compiles or shards the layers it replaces
        apply_liger(model)
    if cp is not None:  # the attention compile and recomputation will see
        use_context_attention(model, cp)
    strategy.experts = mixture_of_experts(model, strategy.layout, env.device.type)
    values = meta_values(strategy, model, optimizer, env, *build, say)
    model = batchnorm(model, strategy, env, config.sync_batchnorm)
    # float8 first, as torchtitan orders it: tp, recomputation, compile and sharding then see its layers; the
    # sharding strategies all-gather tensorwise weights in float8.
    said = convert_linears(model, optimizer, config.float8, env.device, all_gather="shard" in strategy.mesh_dims)
    if said:
        say(said)
    # The blocks a sharding strategy wraps, before it wraps them (its hooks then run around the recomputation).
    units = getattr(strategy, "units", default_units)(model)
    blocks = outermost(units)
    sharded = [*units, *quantized_owners(model)] if hasattr(strategy, "units") else units
    if config.activation_checkpointing == "selective" and len(outermost(sharded)) < len(sharded):
        raise UsageError(
            f"activation_checkpointing selective cannot run where {strategy.name} shards modules inside each block "
            "(4-bit layers, nested blocks): their FSDP hooks run other ops when a block is recomputed, which torch's "
            "selective checkpointing refuses; use full or offload."
        )
    recompute_blocks(model, blocks, config.activation_checkpointing)
    if config.compile:
        compile_blocks(model, blocks, config.compile_backend)
    if plan.params != torch.float32:
        model.to(plan.params)  # bf16-true; on the meta device, free: the values are cast as they arrive
    if values is None:
        model, optimizer = strategy.setup(model, optimizer, env, plan)
    else:
        model, optimizer = strategy.setup_from_meta(model, optimizer, env, plan, values)
    if cp is not None:
        cp.join(strategy.mesh)
    if values is None:
        return model, optimizer
    if values.read is not None:
        say(values.read.summary(values.initialised))
    return model, optimizer


def meta_values(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    env: DistEnv,
    rng: torch.Tensor | None,
    read: SafetensorsCheckpoint | None,
    say: Callable[[str], None],
) -> MetaValues | None:
    """For a model on the meta device: the random stream goes back to where its build began, so the values it is
    given are a plain build's (or the checkpoint's). A strategy that shards (builds_on_meta) gets them from rank 0
    a unit at a time in its setup; any other gets the whole model here, on the CPU. None: nothing left to make."""
    if not on_meta(model):
        return None
    if optimizer is not None and optimizer.state:
        raise UsageError("A model built under engine.init_module needs a fresh optimizer; call setup before stepping.")
    if rng is not None:
        torch.set_rng_state(rng)
    if strategy.builds_on_meta:
        # Only rank 0 makes the values, from a copy of the model as built (before casts and wrappers).
        return MetaValues(copy.deepcopy(model), read) if env.rank == 0 else MetaValues(None)
    names = {id(p): name for name, p in model.named_parameters()}
    initialised = materialize(model, "cpu", read=read)
    repoint(optimizer, names, model)
    if read is not None:
        say(read.summary(initialised))
    return None


def batchnorm(model: nn.Module, strategy: Strategy, env: DistEnv, sync: bool) -> nn.Module:
    """BatchNorm turned into SyncBatchNorm when asked, else a warning where processes or replicas normalise
    alone. A warning, not engine.print: a run that wants per-process statistics can filter it out."""
    layers = sum(isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    if not layers:
        return model
    if sync and strategy.needs_process_group:
        # Keeps the Parameter objects, so an optimizer built before setup stays valid.
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if isinstance(strategy, DataParallel):
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
