"""Precision strings -> what each one means for parameters, autocast and loss scaling."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from multigpu.core.data import map_tensors
from multigpu.core.errors import UsageError

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

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def wrap_forward(self, forward: Callable[..., Any], device: torch.device, use_autocast: bool) -> Callable[..., Any]:
        """`forward` with this precision's casts around it; floating outputs always come back in fp32.

        bf16-true casts floating inputs to bf16 to meet its bf16 weights; mixed modes run under autocast unless
        the strategy casts parameters itself (`use_autocast=False`). fp32 outputs keep losses at full width.
        """
        if self.name == "32":
            return forward
        autocast = self.autocast if use_autocast else lambda device: contextlib.nullcontext()

        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.name == "bf16-true":
                args, kwargs = _cast_floats((args, kwargs), self.param_dtype)
            with autocast(device):
                output = forward(*args, **kwargs)
            return _cast_floats(output, torch.float32)

        return wrapped


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    return map_tensors(data, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)
