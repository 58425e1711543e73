"""torch.nn.DataParallel: one process drives every visible GPU (the guides' simple mode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from multigpu.config.precision import PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.strategies.base import Strategy, move_to_device
from multigpu.strategies.single import Single


class InAutocast:
    """Calls a module under autocast with a given dtype, in whatever thread it runs.

    DataParallel runs each replica in a thread of its own and re-enters autocast there with only the *enabled*
    flag of the caller's, so the replicas compute in the device's default autocast dtype (fp16 on GPUs), not in
    the one the run asked for (bf16).
    """

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class AutocastDataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas compute in the autocast dtype that is active where forward is called."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [InAutocast(replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


@dataclass
class DataParallel(Strategy):
    name = "dp"

    @classmethod
    def build(cls, say: Callable[[str], None], **arguments: Any) -> Strategy:
        """dp drives every visible GPU from one process; with fewer than two there is nothing to split."""
        if torch.cuda.device_count() < 2:
            say(
                f"strategy dp needs 2 or more GPUs and this machine has {torch.cuda.device_count()}; running as single."
            )
            return Single(**arguments)
        return cls(**arguments)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        return AutocastDataParallel(move_to_device(model, env)), optimizer

    # Checkpoints hold the inner module's names, so they load into any other strategy.
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return super().model_state_dict(model.module)

    def full_state_dict(self, model: nn.Module, trainable_only: bool) -> dict[str, Any]:
        return super().full_state_dict(model.module, trainable_only)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        super().load_model_state_dict(model.module, state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return super().optimizer_state_dict(model.module, optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        super().load_optimizer_state_dict(model.module, optimizer, state)
