"""One device, one process, no process group: the baseline every other strategy must reproduce."""

from __future__ import annotations

import torch
from torch import nn

from multigpu.core.env import DistEnv
from multigpu.core.precision import Precision
from multigpu.strategies.base import Strategy, move_to_device


class Single(Strategy):
    name = "single"
    needs_process_group = False

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        return move_to_device(model, env), optimizer
