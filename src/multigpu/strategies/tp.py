"""The `tp` strategy: tensor parallelism over every process, one slice of each planned layer per process
(parallel/tensor_parallel.py splits them, in engine/parallelize.py's tp step; zero2, zero3 and hsdp compose with it
through tp_size)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from multigpu.config.layout import TENSOR, TensorParallelOptions
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.parallel.grad_scaler import DTensorGradScaler
from multigpu.parallel.tensor_parallel import check_sequence_parallel, start_alike
from multigpu.strategies.base import Strategy, move_to_device
from multigpu.strategies.facts import MODEL_PARALLEL, Facts, PlanRow


@dataclass
class TensorParallel(TensorParallelOptions, Strategy):
    """Tensor parallelism over every process: one slice of each planned layer per process, one batch for all."""

    name = "tp"
    facts = Facts(reduces_gradients=False)  # it splits layers: each rank's gradients are its own slices'
    plan_rows = (PlanRow(shown=frozenset({MODEL_PARALLEL})),)
    spread = TENSOR
    mesh_dims = ("tp",)

    def check(self) -> None:
        check_sequence_parallel(self)

    def precision_plan(self, precision: Precision, device: torch.device) -> PrecisionPlan:
        # Split gradients are DTensors beside whole ones: an overflow found in one process's slice must skip the step
        # everywhere.
        plan = super().precision_plan(precision, device)
        return replace(plan, scaler=lambda: DTensorGradScaler(device=device.type)) if plan.scaler else plan

    def make_alike(self, model: nn.Module, env: DistEnv) -> bool:
        move_to_device(model, env)
        start_alike(model, env.device)
        return True

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        # On its device since make_alike, and split by engine/parallelize.py's tp step: tp wraps nothing.
        return model, optimizer
