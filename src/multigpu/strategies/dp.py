"""torch.nn.DataParallel: one process drives every visible GPU (the guides' simple mode)."""

from __future__ import annotations

import torch
from torch import nn

from multigpu.env import DistEnv
from multigpu.precision import Precision
from multigpu.strategies.base import Strategy, move_to_device


class DataParallel(Strategy):
    name = "dp"
    needs_process_group = False

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        return nn.DataParallel(move_to_device(model, env)), optimizer
