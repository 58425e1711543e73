"""How an Engine starts: the strategy that runs (the config's, or the planner's pick for `auto` once engine.setup
sees the model), what it refuses before any process starts, the process group it joins and the seeds. What setup
then does to the model is engine/parallelize.py's."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable
from dataclasses import fields, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import nn

from multigpu.config.layout import AUTO, ParallelDims, node_crossings, resolve_layout
from multigpu.config.pipeline import ZERO_BUBBLE
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.config.settings import strategy_option_fields
from multigpu.core.compute_clock import check_measurable
from multigpu.core.env import DistEnv, check_backend, init_process_group
from multigpu.core.errors import UsageError
from multigpu.core.replica_env import ReplicaGroup
from multigpu.engine.config import EngineConfig
from multigpu.engine.replicas import Replicas
from multigpu.observers.trackers import check_servers, parse_log_to
from multigpu.parallel.context import ContextParallel
from multigpu.planner import choose_strategy
from multigpu.planner.rows import row as planner_row
from multigpu.strategies import Strategy, build_strategy, strategy_class
from multigpu.strategies.compatibility import composes
from multigpu.transforms.float8 import check_float8
from multigpu.transforms.loss import check_runnable as check_loss
from multigpu.transforms.modules import parameters_on_meta


def resolve(given: str | Strategy, env: DistEnv, config: EngineConfig, say: Callable[[str], None]) -> Strategy:
    """The strategy `config` names, built for `env`'s processes, or one sentence refusing it; a line for each of its
    groups that would cross the nodes' boundaries. `given` is what the script passed: a configured Strategy keeps its
    options (its layout resolved for the processes launched, unless it was built with one), unless an observer's
    configure renamed the strategy."""
    strategy = _resolve(given, env, config, say)
    if node_count(env) > 1:
        for line in node_crossings(strategy.layout, env.local_world_size):
            say(f"warning: {line}.")
    return strategy


def _resolve(given: str | Strategy, env: DistEnv, config: EngineConfig, say: Callable[[str], None]) -> Strategy:
    nodes = node_count(env)
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


def node_count(env: DistEnv) -> int:
    """The machines `env`'s processes run on: the layout's default replicas (one per node) and the planner count
    them."""
    return max(1, env.world_size // env.local_world_size)


def precision_plan(strategy: Strategy, config: EngineConfig, env: DistEnv) -> PrecisionPlan:
    """What the run's precision means under `strategy`, once everything the strategy and the settings cannot run on
    this device has been refused."""
    plan = strategy.precision_plan(Precision(config.precision), env.device)
    strategy.check_runnable(env.device, plan)
    check_shared_gpus(strategy, env)
    check_float8(config.float8, env.device)
    # The features of strategies/compatibility.py's table that need the machine: dp runs as single on one GPU.
    if config.sync_batchnorm and not composes(strategy, "sync_batchnorm"):
        raise UsageError(
            "sync_batchnorm needs one process per GPU and strategy dp drives every GPU from one process; "
            "use strategy ddp (multigpu run -n N) or drop sync_batchnorm."
        )
    changed = [
        name
        for name in ("compile", "activation_checkpointing")
        if getattr(config, name) not in (False, "none") and not composes(strategy, name)
    ]
    if changed:
        raise UsageError(
            f"{' and '.join(changed)} cannot run under strategy dp: nn.DataParallel copies the model to each GPU in "
            "every step, and the copies would run the original blocks' forward on the first GPU; use strategy ddp."
        )
    if config.compile and config.activation_checkpointing == "full" and strategy.splits_layers():
        raise UsageError(
            "activation_checkpointing full cannot run with compile under tensor parallelism on torch 2.13: a compiled "
            "block that recomputes attention on tp's split heads saves a DeviceMesh for its backward and fails; use "
            "activation_checkpointing selective (which keeps attention's output) or offload, or drop compile."
        )
    if config.compile and strategy.layout.pp > 1 and config.pp_schedule in ZERO_BUBBLE:
        raise UsageError(
            f"pp_schedule {config.pp_schedule} cannot run with compile on torch 2.13: its split backward runs each "
            "compiled block's backward in two halves over a kept graph, which a compiled backward refuses (pytorch "
            "issue 161904); drop compile, or use pp_schedule gpipe, 1f1b or interleaved."
        )
    if strategy.layout.cp > 1 and config.cp_method == "ring" and env.device.type != "cuda":
        raise UsageError(
            "cp_method ring runs torch's ring attention, which needs CUDA GPUs; use cp_method ulysses (the default) "
            "on this machine."
        )
    find_unused = strategy.finds_unused_parameters()
    head_kept = composes(strategy, "head_after_forward")
    check_loss(config.loss, config.liger, env.device, head_kept, strategy.layout.tp > 1, find_unused)
    if config.sync_batchnorm and strategy.needs_process_group and env.device.type != "cuda":
        raise UsageError(
            "sync_batchnorm synchronises BatchNorm between GPUs, and torch's SyncBatchNorm refuses to run on CPU; "
            "drop sync_batchnorm (--sync-batchnorm) or run on GPUs."
        )
    return plan


def check_shared_gpus(strategy: Strategy, env: DistEnv) -> None:
    """Processes sharing GPUs (--share-gpus) talk over gloo: refuses the layouts whose collectives gloo cannot run on
    CUDA tensors."""
    if not env.shares_gpus or env.world_size == 1:
        return
    layout = strategy.layout
    sizes = {"tp_size": layout.tp, "pp_size": layout.pp, "ep_size": layout.ep}
    needs = [f"{name} {size}" for name, size in sizes.items() if size > 1]
    # Measured on an H200 (torch 2.11, gloo on CUDA tensors): all-reduce, broadcast and all-to-all run; an
    # all-gather (FSDP2's, DTensor's) crashes the process, and send/recv (pipeline stages) abort with "Bad address":
    # the strategies that run with shared_gpus (composes_with) only all-reduce.
    if not composes(strategy, "shared_gpus"):
        needs.insert(0, f"strategy {strategy.name}")
    if needs:
        raise UsageError(
            f"{env.local_world_size} processes sharing {torch.cuda.device_count()} GPU(s) talk over gloo, whose "
            f"all-gathers and sends crash on CUDA tensors, and {' with '.join(needs)} needs them; share GPUs under "
            "strategy ddp or zero1 (cp_size and batch_shares work too), or give each process a GPU of its own."
        )


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
        check_backend(config.backend, env)
    for name in ("batch_shares", "pp_split"):
        if (getattr(config, name) or "").strip() == AUTO:
            check_measurable(env.device.type, name)
    if config.log_dir is not None:  # the main worker would refuse it after the launch, and the others wait meanwhile
        check_servers(parse_log_to(config.log_to, config.log_dir))
    return strategy.layout


NEEDS_REPLICA_GROUPS = (
    "fault_tolerance trains replica groups; pass --replica-groups N (2 or more) to multigpu run, train, finetune or "
    "demo, or drop fault_tolerance."
)


def with_replicas(config: EngineConfig, group: ReplicaGroup | None) -> EngineConfig:
    """`config` under the replica group this process was launched in: a launch with replica groups trains under
    fault tolerance whatever the script asked (its groups would otherwise train apart); fault tolerance without
    one is refused."""
    if group is None:
        if config.fault_tolerance:
            raise UsageError(NEEDS_REPLICA_GROUPS)
        return config
    return config if config.fault_tolerance else replace(config, fault_tolerance=True)


def replicas(group: ReplicaGroup, env: DistEnv, config: EngineConfig, state: Callable[[], dict[str, Any]]) -> Replicas:
    """torchft's Manager for this process's replica group (engine/replicas.py), once its own group is joined."""
    return Replicas(group, env, config.timeout_s, state)


def join(env: DistEnv, strategy: Strategy, config: EngineConfig) -> None:
    """Joins the process group the strategy needs, then seeds every generator the same on every rank, so that
    models built afterwards start identical everywhere."""
    if strategy.needs_process_group:
        backend = config.backend or env.default_backend()
        init_process_group(env, backend, timedelta(seconds=config.timeout_s))
    elif config.backend is not None:
        check_backend(config.backend, env)
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
    kind = "sgd" if isinstance(optimizer, torch.optim.SGD) else config.optimizer  # a script's own: as AdamW
    name, reason, ep_size = choose_strategy(
        model,
        kind,
        gpus=env.local_world_size,
        nodes=node_count(env),
        gpu_bytes=memory,
        precision=config.precision,
        offload_possible=env.device.type == "cuda",
        grad_accum_steps=config.grad_accum_steps,
        unsharded_grad_accum=config.unsharded_grad_accum,
        per="GPU" if env.device.type == "cuda" else "process",
        ep_size=config.ep_size,
    )
    say(f"strategy auto -> {name}: {reason}")
    row = planner_row(name)  # a planner row: a registered strategy and the options it runs with
    cls = strategy_class(row.strategy)
    takes = {f.name for f in fields(cls)} - set(cls.not_taken)
    chosen = replace(
        config,
        strategy=row.strategy,
        cpu_offload=bool(row.options.get("cpu_offload", False)),
        unsharded_grad_accum="unsharded_grad_accum" in takes and config.unsharded_grad_accum,
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


def check_optimizer(config: EngineConfig, optimizer: torch.optim.Optimizer | None, built: list) -> None:
    """Refuses an optimizer setting that the optimizer given to setup is not: only engine.optimizer builds it."""
    if config.optimizer != "adamw" and optimizer is not None and not any(optimizer is b for b in built):
        raise UsageError(
            f"optimizer {config.optimizer} is built by engine.optimizer(model, lr), and this script gave setup a "
            f"{type(optimizer).__name__} of its own; build it with engine.optimizer, or drop the optimizer setting."
        )
