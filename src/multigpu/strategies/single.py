"""One device, one process, no process group: the baseline every other strategy must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from multigpu.config.precision import PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.strategies.base import COMMON_FEATURES, Strategy, move_to_device
from multigpu.strategies.facts import ONE_GPU, Facts, PlanRow


@dataclass
class Single(Strategy):
    name = "single"
    facts = Facts(reduces_gradients=False, one_process=True)
    composes_with = COMMON_FEATURES | {"fault_tolerance"}  # a replica group of one process
    plan_rows = (PlanRow(order=0, shown=frozenset({ONE_GPU}), recommended=frozenset({ONE_GPU})),)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        return move_to_device(model, env), optimizer
