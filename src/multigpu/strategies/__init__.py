"""Strategy names -> strategy objects. The names are public; each strategy lives in its own file."""

from __future__ import annotations

from collections.abc import Callable

import torch

from multigpu.env import DistEnv
from multigpu.errors import UsageError
from multigpu.strategies.base import Strategy
from multigpu.strategies.ddp import DDP
from multigpu.strategies.deepspeed import DeepSpeed, DeepSpeedOptions, check_installed
from multigpu.strategies.dp import DataParallel
from multigpu.strategies.fsdp import FSDP
from multigpu.strategies.single import Single
from multigpu.strategies.zero1 import Zero1

_FACTORIES: dict[str, Callable[[], Strategy]] = {
    "single": Single,
    "dp": DataParallel,
    "ddp": DDP,
    "zero1": Zero1,
    "zero2": lambda: FSDP(reshard_after_forward=False),
    "zero3": FSDP,
    "fsdp": FSDP,
    "deepspeed": DeepSpeed,
}
STRATEGIES = ("auto", *_FACTORIES)

__all__ = [
    "DDP",
    "FSDP",
    "STRATEGIES",
    "DataParallel",
    "DeepSpeed",
    "DeepSpeedOptions",
    "Single",
    "Strategy",
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
    elif spec == "auto" and env.is_distributed:
        strategy = DDP()  # joins the process group now; Engine.setup asks the planner once it sees the model
    elif spec == "auto":
        strategy = Single()
        say("strategy auto -> single (1 process)")
    elif spec == "dp" and torch.cuda.device_count() < 2:
        say(f"strategy dp needs 2 or more GPUs and this machine has {torch.cuda.device_count()}; running as single.")
        strategy = Single()
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
    if not strategy.needs_process_group and env.is_distributed:
        raise UsageError(
            f"Strategy {strategy.name} runs in one process, but {env.world_size} were launched and would each "
            "train alone; launch one process, or use ddp/zero1/zero2/zero3."
        )
    return strategy
