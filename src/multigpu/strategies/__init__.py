"""Strategy names -> strategy objects. The names are public; each strategy lives in its own file."""

from __future__ import annotations

from collections.abc import Callable

import torch

from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.strategies.base import Strategy
from multigpu.strategies.ddp import DDP
from multigpu.strategies.deepspeed import DeepSpeed, DeepSpeedOptions, check_installed
from multigpu.strategies.dp import DataParallel
from multigpu.strategies.fsdp import FSDP
from multigpu.strategies.hsdp import HSDP
from multigpu.strategies.pp import PipelineParallel
from multigpu.strategies.single import Single
from multigpu.strategies.tp import TensorParallel
from multigpu.strategies.zero1 import Zero1

_FACTORIES: dict[str, Callable[[], Strategy]] = {
    "single": Single,
    "dp": DataParallel,
    "ddp": DDP,
    "zero1": Zero1,
    "zero2": lambda: FSDP(reshard_after_forward=False),
    "zero3": FSDP,
    "fsdp": FSDP,
    "hsdp": HSDP,
    "tp": TensorParallel,
    "pp": PipelineParallel,
    "deepspeed": DeepSpeed,
}
STRATEGIES = ("auto", *_FACTORIES)

__all__ = [
    "DDP",
    "FSDP",
    "HSDP",
    "STRATEGIES",
    "DataParallel",
    "DeepSpeed",
    "DeepSpeedOptions",
    "PipelineParallel",
    "Single",
    "Strategy",
    "TensorParallel",
    "Zero1",
    "resolve_strategy",
]


def resolve_strategy(
    spec: str | Strategy,
    env: DistEnv,
    cpu_offload: bool = False,
    say: Callable[[str], None] = print,
    deepspeed: DeepSpeedOptions | None = None,
    max_grad_norm: float | None = None,
    unsharded_grad_accum: bool = False,
    find_unused_parameters: bool = False,
    sync_batchnorm: bool = False,
    replicate: int | None = None,
    tp_size: int | None = None,
    pipeline: tuple[str, int, int | None] = ("1f1b", 1, None),
    pp_size: int | None = None,
    sequence_parallel: bool = False,
) -> Strategy:
    """Turns a strategy name (or a configured Strategy) into the Strategy that will run, or refuses."""
    deepspeed = deepspeed or DeepSpeedOptions()
    if deepspeed.given and spec != "deepspeed":
        raise UsageError(
            "zero_stage, offload_optimizer, offload_param and deepspeed_config are options of strategy deepspeed; "
            "drop them or choose strategy deepspeed."
        )
    if isinstance(spec, Strategy):
        strategy = spec
    elif spec not in STRATEGIES:
        raise UsageError(f"Unknown strategy {spec!r}; choose one of {', '.join(STRATEGIES)}.")
    elif spec == "auto" and (tp_size not in (None, 1) or pp_size not in (None, 1)):
        raise UsageError(
            "Strategy auto does not choose tensor or pipeline parallelism; name the strategy to run them with (tp, "
            "pp, zero2, zero3 or hsdp) beside tp_size and pp_size."
        )
    elif spec == "auto" and env.is_distributed:
        strategy = DDP()  # joins the process group now; Engine.setup asks the planner once it sees the model
    elif spec == "auto":
        strategy = Single()
        say("strategy auto -> single (1 process)")
    elif spec == "dp" and torch.cuda.device_count() < 2:
        say(f"strategy dp needs 2 or more GPUs and this machine has {torch.cuda.device_count()}; running as single.")
        strategy = Single()
    elif spec == "pp":
        strategy = PipelineParallel(*pipeline, size=pp_size)
    elif spec == "deepspeed":
        check_installed()
        strategy = DeepSpeed(deepspeed, max_grad_norm)
    else:
        strategy = _FACTORIES[spec]()

    if isinstance(strategy, DeepSpeed) and strategy.max_grad_norm is None:
        strategy.max_grad_norm = max_grad_norm  # DeepSpeed clips inside its step, so it must know the limit
    if cpu_offload and not (spec == "auto" and env.is_distributed):  # auto: the planner decides at setup
        if not isinstance(strategy, FSDP) or not strategy.reshard_after_forward:
            raise UsageError(f"cpu_offload works with strategy zero3 only, not {strategy.name}; drop it or use zero3.")
        strategy.cpu_offload = True
    if unsharded_grad_accum and not (spec == "auto" and env.is_distributed):
        if not isinstance(strategy, FSDP):
            raise UsageError(
                f"unsharded_grad_accum changes how zero2 and zero3 accumulate gradients, and {strategy.name} "
                "has nothing to change; drop it or use zero2/zero3."
            )
        strategy.unsharded_grad_accum = True
    if isinstance(strategy, FSDP) and strategy.cpu_offload and env.device.type != "cuda":
        raise UsageError(
            "cpu_offload moves sharded parameters from the GPU to CPU memory, but this run is on CPU "
            "already; drop cpu_offload or run on GPUs."
        )
    if find_unused_parameters and isinstance(strategy, DDP):
        # Other strategies take parameters without gradients as they come, so the option asks nothing of them.
        strategy.find_unused_parameters = True
    if replicate is not None and not isinstance(strategy, HSDP):
        raise UsageError(f"replicate is hsdp's number of replicas; drop it or use strategy hsdp, not {strategy.name}.")
    if isinstance(strategy, HSDP) and strategy.replicate is None:
        # By default one replica per node: each node shards the model (a pipeline stage of it) over its own links.
        nodes = max(1, env.world_size // env.local_world_size)
        strategy.replicate = replicate or max(1, nodes // (pp_size or 1))
    strategy = in_pipeline(strategy, pipeline, pp_size)
    set_tp(strategy, tp_size, env)
    set_sequence_parallel(strategy, sequence_parallel)
    check_sync_batchnorm(sync_batchnorm, strategy, env)
    if not strategy.needs_process_group and env.is_distributed:
        raise UsageError(
            f"Strategy {strategy.name} runs in one process, but {env.world_size} were launched and would each "
            "train alone; launch one process, or use ddp/zero1/zero2/zero3."
        )
    return strategy


def in_pipeline(strategy: Strategy, pipeline: tuple[str, int, int | None], pp_size: int | None) -> Strategy:
    """`strategy` inside a pipeline of `pp_size` ranks (zero2, zero3 and hsdp shard each stage), or refuses
    pipeline options that a strategy without a pipeline would ignore."""
    if isinstance(strategy, PipelineParallel) or ((pp_size or 1) == 1 and pipeline == ("1f1b", 1, None)):
        return strategy
    if pp_size in (None, 1):
        raise UsageError(
            f"pp_schedule, pp_stages_per_rank and pp_microbatches are options of pipelines (strategy pp, or "
            f"pp_size), not of {strategy.name} alone; drop them, or add pp_size or use strategy pp."
        )
    if not isinstance(strategy, FSDP) or strategy.cpu_offload or strategy.unsharded_grad_accum:
        options = " with cpu_offload or unsharded_grad_accum" if isinstance(strategy, FSDP) else ""
        raise UsageError(
            f"pp_size runs pipeline stages with zero2, zero3 or hsdp inside them (or whole replicas with strategy "
            f"pp), not {strategy.name}{options}; choose one of those or drop pp_size."
        )
    return PipelineParallel(*pipeline, size=pp_size, data=strategy)


def set_tp(strategy: Strategy, tp_size: int | None, env: DistEnv) -> None:
    """Gives `strategy` its tensor-parallel degree (tp: every process unless told), or refuses one it cannot run."""
    if isinstance(strategy, TensorParallel):
        strategy.tp = tp_size or env.world_size
        return
    if tp_size is None or tp_size == 1:
        return
    if not strategy.composes_with_tp:
        # ddp's replicas inside tensor parallelism are hsdp's with one process per shard (FSDP2 takes DTensors).
        raise UsageError(
            f"tp_size splits layers alone (strategy tp) or inside the data parallelism of zero2, zero3 or hsdp, not "
            f"{strategy.name}; choose one of those (ddp's whole replicas: hsdp with --replicate processes/tp_size) "
            "or drop tp_size."
        )
    strategy.tp = tp_size
    if isinstance(strategy, PipelineParallel) and strategy.data is not None:
        strategy.data.tp = tp_size


def set_sequence_parallel(strategy: Strategy, sequence_parallel: bool) -> None:
    """Turns sequence parallelism on where tp runs, or refuses it."""
    if not sequence_parallel:
        return
    if strategy.tp == 1:
        raise UsageError(
            "sequence_parallel splits the sequence over the tp processes, and this run has no tensor parallelism; "
            "add tp_size (or strategy tp), or drop sequence_parallel."
        )
    strategy.sequence_parallel = True
    if isinstance(strategy, PipelineParallel) and strategy.data is not None:
        strategy.data.sequence_parallel = True


def check_sync_batchnorm(sync_batchnorm: bool, strategy: Strategy, env: DistEnv) -> None:
    """Refuses sync_batchnorm where torch cannot synchronise BatchNorm; in one process it has nothing to do."""
    if not sync_batchnorm:
        return
    if isinstance(strategy, DataParallel):
        raise UsageError(
            "sync_batchnorm needs one process per GPU and strategy dp drives every GPU from one process; "
            "use strategy ddp (multigpu run -n N) or drop sync_batchnorm."
        )
    if strategy.needs_process_group and env.device.type != "cuda":
        raise UsageError(
            "sync_batchnorm synchronises BatchNorm between GPUs, and torch's SyncBatchNorm refuses to run on CPU; "
            "drop sync_batchnorm (--sync-batchnorm) or run on GPUs."
        )
