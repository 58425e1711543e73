"""ZeRO stage 1: DDP for gradients, optimizer states sharded across ranks by ZeroRedundancyOptimizer."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from multigpu.config.layout import OPTIMIZER_SHARDS
from multigpu.config.precision import PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.parallel.mesh import with_cp
from multigpu.strategies.ddp import DDP
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


@dataclass
class Zero1(DDP):
    name = "zero1"
    composes_with = DDP.composes_with - {"fault_tolerance"}  # its optimizer's states are sharded inside a group
    facts = Facts(
        MemoryModel(frozenset({"optimizer"}), temporary=GRAD_BUCKET),
        Communication(ALL_REDUCE, gathers_after_step=True),
    )
    plan_rows = (PlanRow(order=3, shown=frozenset({ONE_GPU, DATA_PARALLEL}), recommended=frozenset({DATA_PARALLEL})),)
    spread = OPTIMIZER_SHARDS

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        model, optimizer = super().setup(model, optimizer, env, plan)
        if optimizer is None:
            return model, None
        if optimizer.state:
            raise UsageError("zero1 must shard a fresh optimizer; call engine.setup before the first optimizer step.")
        groups = [dict(group) for group in optimizer.param_groups]
        # `defaults` can hold derived keys the constructor rejects (AdamW's decoupled_weight_decay);
        # the groups carry every hyperparameter anyway.
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
        # A new optimizer object: schedulers must be built on the one engine.setup returns.
        # States are sharded across the replicas that average gradients: the mesh DDP.setup built.
        group = with_cp(self.mesh, ("replicate",)).get_group()
        sharded = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group, **defaults)
        return model, sharded

    # Each rank saves the states of the parameters it owns, keyed by parameter name: together they form the
    # whole optimizer, which DCP can hand out again under any other partition, world size or strategy.
    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return super().optimizer_state_dict(model, optimizer.optim)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        super().load_optimizer_state_dict(model, optimizer.optim, state)
        # The wrapper's groups are what schedulers change and what it copies into the local optimizer each step.
        for outer, local in zip(optimizer.param_groups, optimizer.optim.param_groups, strict=True):
            outer.update({key: value for key, value in local.items() if key != "params"})
