"""Precision strings -> what each one means for parameters, autocast and loss scaling."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from multigpu.errors import UsageError

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
    def needs_grad_scaler(self) -> bool:
        # fp16's narrow exponent underflows small gradients; bf16 shares fp32's exponent and needs no scaling.
        return self.name == "fp16-mixed"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)
