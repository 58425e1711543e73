"""torch.nn.DataParallel: one process drives every visible GPU (the guides' simple mode); batch_shares gives each
GPU its part of every batch (GPU 0, which also gathers the outputs and holds the loss, can take less)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel._functions import Scatter

from multigpu.config.layout import AUTO, EVEN, IN_PROCESS, Spread, parse_shares, split_by_shares
from multigpu.config.precision import PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.strategies.base import COMMON_FEATURES, Strategy, move_to_device
from multigpu.strategies.facts import ONE_GPU, Facts, PlanRow
from multigpu.strategies.single import Single


def check_gpu_shares(text: str, gpus: int) -> None:
    """One sentence refuses dp's batch_shares where they do not name one weight per GPU."""
    if text.strip() == AUTO:
        raise UsageError(
            "batch_shares auto measures each process's speed, and dp drives every GPU from one process; give dp one "
            "weight per GPU (e.g. 1,2 for GPU 0 to take a third), or use ddp, which auto balances."
        )
    shares = parse_shares(text)
    if shares is not None and (gpus < 2 or len(shares) != gpus):
        raise UsageError(
            f"batch_shares {text} splits each batch over dp's GPUs, and this machine has {gpus}; give one weight per "
            "GPU, or drop batch_shares."
        )


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
    """nn.DataParallel whose replicas compute in the autocast dtype that is active where forward is called, each
    GPU given its part of every batch by `shares` (None: torch's equal chunks)."""

    def __init__(self, module: nn.Module, shares: tuple[float, ...] | None = None) -> None:
        super().__init__(module)
        self.shares = shares

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[int]) -> Any:
        if self.shares is None:
            return super().scatter(inputs, kwargs, device_ids)
        return scatter_by_shares(inputs, kwargs, device_ids, self.shares, self.dim)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [InAutocast(replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


def scatter_by_shares(
    inputs: Any, kwargs: Any, device_ids: Sequence[int], shares: tuple[float, ...], dim: int = 0
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """DataParallel's scatter of a call's arguments, each tensor's rows split by `shares` (split_by_shares: each
    GPU at least one) rather than into equal chunks; other values go to every GPU as they are. The gathered outputs
    come back in the same row order, so the loss over them is the one an even split gives."""
    first = next((t for t in _tensors((inputs, kwargs)) if t.dim() > dim), None)
    if first is None or first.shape[dim] < len(device_ids):  # too few rows for every GPU: torch's own split
        return nn.parallel.scatter_gather.scatter_kwargs(inputs, kwargs, device_ids, dim)
    sizes = split_by_shares(first.shape[dim], shares)

    def split(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor):
            return list(Scatter.apply(device_ids, sizes, dim, value))
        if isinstance(value, (tuple, list)) and value:
            return [type(value)(parts) for parts in zip(*map(split, value), strict=True)]
        if isinstance(value, dict) and value:
            per_gpu = zip(*map(split, value.values()), strict=True)
            return [type(value)(zip(value, parts, strict=True)) for parts in per_gpu]
        return [value for _ in device_ids]

    return tuple(split(tuple(inputs))), tuple(split(dict(kwargs or {})))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [tensor for item in items for tensor in _tensors(item)]


@dataclass
class DataParallel(Strategy):
    name = "dp"
    facts = Facts(reduces_gradients=False, one_process=True)
    plan_rows = (PlanRow(order=1, shown=frozenset({ONE_GPU})),)
    spread: ClassVar[Spread] = IN_PROCESS
    # nn.DataParallel copies the model to each GPU every step, from one process: the copies run the original
    # blocks (not compiled or checkpointed ones), and there is no process group for SyncBatchNorm.
    composes_with = COMMON_FEATURES - {"compile", "activation_checkpointing", "sync_batchnorm"}
    batch_shares: str = EVEN  # one weight per GPU (the Engine setting's)

    @classmethod
    def build(cls, say: Callable[[str], None], **arguments: Any) -> Strategy:
        """dp drives every visible GPU from one process; with fewer than two there is nothing to split."""
        check_gpu_shares(arguments.get("batch_shares", EVEN), torch.cuda.device_count())
        if torch.cuda.device_count() < 2:
            say(
                f"strategy dp needs 2 or more GPUs and this machine has {torch.cuda.device_count()}; running as single."
            )
            return Single(**{key: value for key, value in arguments.items() if key != "batch_shares"})
        return cls(**arguments)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        return AutocastDataParallel(move_to_device(model, env), parse_shares(self.batch_shares)), optimizer

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
