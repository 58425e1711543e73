"""torch.nn.DataParallel: one process drives every visible GPU (the guides' simple mode)."""

from __future__ import annotations

from typing import Any

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

    # Checkpoints hold the inner module's names, so they load into any other strategy.
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return super().model_state_dict(model.module)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        super().load_model_state_dict(model.module, state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return super().optimizer_state_dict(model.module, optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        super().load_optimizer_state_dict(model.module, optimizer, state)
