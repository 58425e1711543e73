"""The `tp` strategy: tensor parallelism over every process, one slice of each planned layer per process
(parallel/tensor_parallel.py splits them; zero2, zero3 and hsdp compose with it through tp_size)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from multigpu.config.layout import TENSOR, TensorParallelOptions
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.models.modules import repoint
from multigpu.parallel.tensor_parallel import check_sequence_parallel, start_alike, tensor_parallelize
from multigpu.strategies.base import Strategy, move_to_device


@dataclass
class TensorParallel(TensorParallelOptions, Strategy):
    """Tensor parallelism over every process: one slice of each planned layer per process, one batch for all."""

    name = "tp"
    spread = TENSOR
    mesh_dims = ("tp",)

    def check(self) -> None:
        check_sequence_parallel(self)

    def precision_plan(self, precision: Precision, device: torch.device) -> PrecisionPlan:
        from multigpu.strategies.fsdp import DTensorGradScaler

        # Split gradients are DTensors beside whole ones: an overflow found in one process's slice must skip the step
        # everywhere.
        plan = super().precision_plan(precision, device)
        return replace(plan, scaler=lambda: DTensorGradScaler(device=device.type)) if plan.scaler else plan

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        mesh = self.build_mesh(env)
        names = {id(p): name for name, p in model.named_parameters()}
        model = move_to_device(model, env)
        start_alike(model, env.device)
        tensor_parallelize(model, mesh["tp"], self.sequence_parallel)
        repoint(optimizer, names, model)
        return model, optimizer
