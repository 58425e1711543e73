"""DistributedDataParallel: a full replica per process, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.config.layout import REPLICAS
from multigpu.config.precision import PrecisionPlan
from multigpu.config.settings import Settings, setting
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.parallel.compression import CompressionOptions
from multigpu.parallel.mesh import with_cp
from multigpu.strategies.base import COMMON_FEATURES, Strategy, move_to_device
from multigpu.strategies.facts import (
    ALL_REDUCE,
    DATA_PARALLEL,
    GRAD_BUCKET,
    ONE_GPU,
    Communication,
    Facts,
    MemoryModel,
    PlanRow,
)

# DDP's reducer notices a bucket left waiting only when the next forward starts, and says so in these words.
UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


@dataclass
class DDPOptions(Settings):
    """DDP's own option; the other strategies take parameters without gradients as they come, so it asks nothing of
    them and they do not refuse it."""

    find_unused_parameters: bool = setting(
        False,
        "ddp/zero1: let some parameters get no gradient in a step (costs a pass over the autograd graph every step)",
    )

    def finds_unused_parameters(self) -> bool:
        """Strategy.finds_unused_parameters, for the strategies that take this option."""
        return self.find_unused_parameters


@dataclass
class DDP(CompressionOptions, DDPOptions, Strategy):
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    #: PowerSGD's state (parallel/powersgd.py), saved per rank in checkpoints; None without powersgd.
    powersgd: Any = field(default=None, init=False, repr=False, compare=False)

    name = "ddp"
    facts = Facts(MemoryModel(temporary=GRAD_BUCKET), Communication(ALL_REDUCE))
    plan_rows = (PlanRow(order=2, shown=frozenset({ONE_GPU, DATA_PARALLEL}), recommended=frozenset({DATA_PARALLEL})),)
    spread = REPLICAS
    # PowerSGD is a DDP communication hook; gloo, which processes sharing GPUs talk over, runs its all-reduces.
    composes_with = COMMON_FEATURES | {"powersgd", "shared_gpus", "fault_tolerance"}
    mesh_dims = ("replicate",)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        mesh = self.build_mesh(env)
        # On its device since make_alike: a move here would swap ep's DTensors, dropping hold_experts's hooks.
        if self.layout.ep > 1:  # ep spread the experts (engine/parallelize.py); DDP replicates the rest
            from multigpu.parallel.expert_parallel import leave_out_of_ddp

            leave_out_of_ddp(model)
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model,
            device_ids=device_ids,
            # The replicate dimension of the strategy's mesh (with cp's ranks), as its group: given a mesh sliced
            # from another, DDP would turn every DTensor parameter (ep's experts, which it leaves out) into a plain
            # attribute around each forward, as it does for tp.
            process_group=with_cp(mesh, ("replicate",)).get_group(),
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )
        if not (self.find_unused_parameters or self.static_graph):  # both change what that error means
            wrapped.forward = self._explaining_unused(wrapped)
        if self.compression.kind != "none":
            from multigpu.parallel.powersgd import register  # torch's hooks, imported only by runs that use them

            self.powersgd = register(wrapped, self.compression, with_cp(mesh, ("replicate",)).get_group())
        return wrapped, optimizer

    def make_alike(self, model: nn.Module, env: DistEnv) -> bool:
        # Onto its device before tp and ep, so that nothing moves it once hold_experts has hooked ep's experts;
        # DDP itself gives every rank rank 0's weights as it wraps.
        move_to_device(model, env)
        return False

    def communication_state(self) -> dict[str, Any] | None:
        """This rank's PowerSGD state for a checkpoint (checkpoint/), or None without powersgd."""
        return None if self.powersgd is None else self.powersgd.state_dict()

    def load_communication_state(self, read: Callable[[int], Any], rank: int) -> None:
        """Puts back the PowerSGD state a checkpoint holds; `read(r)` is rank r's (None where none was saved)."""
        from multigpu.parallel.powersgd import load_keeper_state

        load_keeper_state(self.powersgd, read, rank)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()

    def _explaining_unused(self, model: DistributedDataParallel) -> Callable[..., Any]:
        """DDP's forward, its long error about parameters that got no gradient turned into the option to set."""
        forward = model.forward

        @functools.wraps(forward)
        def explained(*args: Any, **kwargs: Any) -> Any:
            try:
                return forward(*args, **kwargs)
            except RuntimeError as error:
                if UNFINISHED_REDUCTION not in str(error):
                    raise
                unused = unused_parameter_names(model, str(error))
                raise UsageError(
                    f"Parameters {unused} got no gradient in the last backward, so {self.name} could not average "
                    "the gradients; pass find_unused_parameters=True to the Engine (--find-unused-parameters), or "
                    "make every parameter take part in the loss."
                ) from None

        return explained


def unused_parameter_names(model: DistributedDataParallel, message: str, shown: int = 5) -> str:
    """The names of the parameters DDP's error counts as unused, from the indices it gives.

    By the time DDP raises (the next forward) the optimizer step has set every gradient to None, so the error's
    indices are the only record left; they index the trainable, not ignored parameters in named_parameters order.
    """
    match = _UNUSED_INDICES.search(message)
    if match is None:
        return "of the model"
    trainable = [
        name
        for name, p in model.module.named_parameters()
        if p.requires_grad and name not in model.parameters_to_ignore
    ]
    names = [trainable[int(i)] for i in match.group(1).split() if int(i) < len(trainable)]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more if names else "of the model"
