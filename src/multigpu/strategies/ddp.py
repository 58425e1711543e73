"""DistributedDataParallel: a full replica per process, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.env import DistEnv
from multigpu.precision import Precision
from multigpu.strategies.base import Strategy, move_to_device


@dataclass
class DDP(Strategy):
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    static_graph: bool = False

    name = "ddp"

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        model = move_to_device(model, env)
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )
        return wrapped, optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()
