"""Optimizers a run builds from its settings: AdamW, Muon right under every split of the weights, and AdamW with
its states in 16, 8 or 4 bits."""

from typing import Any

from multigpu.core.lazy import imported

# Imported on first use: the low-bit ones import torchao, which takes seconds.
_PUBLIC = {
    "build_optimizer": "multigpu.optimizers.build",
    "muon_groups": "multigpu.optimizers.build",
    "Muon": "multigpu.optimizers.muon",
    "AdamWBf16": "multigpu.optimizers.low_bit",
    "AdamW8bit": "multigpu.optimizers.low_bit",
    "AdamW4bit": "multigpu.optimizers.low_bit",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'multigpu.optimizers' has no attribute {name!r}")
    return imported(f"{_PUBLIC[name]}:{name}")
