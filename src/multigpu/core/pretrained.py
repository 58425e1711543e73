"""Pretrained weights read from Hugging Face safetensors files one tensor at a time, never a whole model at once."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from multigpu.core.errors import UsageError

#: peft's LoRA wraps a base model: its names gain a "base_model.model." prefix and a ".base_layer" inside each
#: adapted layer. The checkpoint holds the base model's own names.
_PEFT_WRAPPING = (re.compile(r"^base_model\.model\."), re.compile(r"\.base_layer(?=\.)"))


class SafetensorsCheckpoint:
    """The tensors of a `.safetensors` file, or of every one in a directory (a sharded Hugging Face checkpoint),
    found by the names of the model they are loaded into. Only the headers are read on opening."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else [self.path]
        if not files or not all(f.is_file() for f in files):
            raise UsageError(
                f"{self.path} holds no .safetensors file; pass a Hugging Face model directory or a .safetensors file."
            )
        self._files: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                self._files.update(dict.fromkeys(handle.keys(), file))
        self.read_names: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor | None:
        """The stored tensor for the model's `name` (as stored: its own dtype), or None where there is none."""
        key = self.key(name)
        if key is None:
            return None
        self.read_names.add(key)
        # A file opened per tensor: the tensor is a view of the file's memory map, and an open map keeps every
        # page read through it resident, so one handle for the whole load would end up holding the whole file.
        with safe_open(str(self._files[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    def key(self, name: str) -> str | None:
        if name in self._files:
            return name
        base = name
        for wrapping in _PEFT_WRAPPING:
            base = wrapping.sub("", base)
        return base if base in self._files else None

    def unread(self) -> list[str]:
        """The stored tensors no parameter or buffer asked for (a tied head stored twice, stale buffers)."""
        return sorted(set(self._files) - self.read_names)

    def summary(self, initialised: list[str]) -> str:
        """One line on what a load read, what it initialised instead and what it left, so that nothing is silent."""
        line = f"loaded {len(self.read_names)} tensors from {self.path}"
        if initialised:
            line += f"; initialised {len(initialised)} it does not hold ({_few(initialised)})"
        unread = self.unread()
        if unread:
            line += f"; left {len(unread)} the model has no place for ({_few(unread)})"
        return line


def _few(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
