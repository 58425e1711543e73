"""Precision strings -> what each one means for parameters, autocast and loss scaling."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from multigpu.core.errors import UsageError
from multigpu.core.tensor_trees import map_tensors

PRECISIONS = ("32", "bf16-mixed", "fp16-mixed", "bf16-true")


@dataclass(frozen=True)
class Precision:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise UsageError(f"Unknown precision {self.name!r}; choose one of {', '.join(PRECISIONS)}.")

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters are *stored* in; mixed modes keep fp32 master weights."""
        return torch.bfloat16 if self.name == "bf16-true" else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The lower dtype that mixed modes compute in, or None for full-width compute."""
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.name)

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype matrix products run in: the autocast dtype in mixed modes, else the parameters' dtype."""
        return self.compute_dtype or self.param_dtype

    @property
    def needs_grad_scaler(self) -> bool:
        # fp16's narrow exponent underflows small gradients; bf16 shares fp32's exponent and needs no scaling.
        return self.name == "fp16-mixed"


@dataclass(frozen=True)
class PrecisionPlan:
    """What a precision means under one strategy, decided in the strategy's `precision_plan` (strategies/base.py):
    the dtype the Engine's autocast computes in (None: no autocast, as where the strategy casts itself), the dtype
    parameters are stored in, and what makes the loss scaler. A strategy that casts itself adds its own fields in a
    subclass (FSDP's MixedPrecisionPolicy, DeepSpeed's config section)."""

    precision: Precision
    autocast: torch.dtype | None = None
    params: torch.dtype = torch.float32
    scaler: Callable[[], Any] | None = None

    def autocast_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)

    def wrap_forward(self, forward: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
        """`forward` with this plan's casts around it; floating outputs always come back in fp32.

        Parameters stored in a lower dtype (bf16-true) get their floating inputs cast to it; mixed precision runs
        under autocast where the plan says so. fp32 outputs keep losses at full width.
        """
        if self.precision.name == "32":
            return forward

        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.params != torch.float32:
                args, kwargs = _cast_floats((args, kwargs), self.params)
            with self.autocast_context(device):
                output = forward(*args, **kwargs)
            return _cast_floats(output, torch.float32)

        return wrapped


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    return map_tensors(data, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)
