"""Pretrained weights read from Hugging Face safetensors files one tensor at a time, never a whole model at once;
and the file mode of the safetensors files the project writes."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

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
        self.shapes: dict[str, list[int]] = {}  # from the headers: every stored tensor's shape, no data read
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 (a safe_open handle has keys(), no __iter__)
                        self._files[key] = file
                        self.shapes[key] = list(handle.get_slice(key).get_shape())
            except SafetensorError as error:
                raise UsageError(f"{file} {damage(file, error)}; copy or save it again.") from None
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

    def file(self, key: str) -> Path:
        return self._files[key]

    def check_fits(self, shapes: Mapping[str, Iterable[int]], whose: str, advice: str) -> None:
        """Refuses, before any value is read, a stored tensor whose shape is not the one `shapes` gives its name
        (the model's parameters and buffers): one sentence naming the tensor, the file, `whose` shape it is not
        (e.g. "in the model") and the `advice`."""
        for name, shape in shapes.items():
            key = self.key(name)
            if key is not None and self.shapes[key] != list(shape):
                raise UsageError(
                    f"{key} is {self.shapes[key]} in {self._files[key]} but {list(shape)} {whose}; {advice}."
                )

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


def damage(file: Path, error: SafetensorError) -> str:
    """What is wrong with a safetensors file that safetensors refuses to open, as the end of a sentence naming it.
    A file cut short (a copy or download that stopped) says how much of it is there: its header ends where the
    data begins, and the last tensor's end offset is where the data ends."""
    try:
        with file.open("rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        needed, size = 8 + header_size + max(ends, default=0), file.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        needed = size = 0  # the header itself is damaged: safetensors' own words say how
    if size < needed:
        return f"is cut short: {size:,} of the {needed:,} bytes its header describes are there"
    return f"is not a readable safetensors file ({error})"


def give_usual_mode(paths: Iterable[Path]) -> None:
    """Gives each file the mode a file this process creates gets (0o666 less the umask), as every other file in a
    model directory has. safetensors 0.8 writes through a temporary file made 0o600 and renames it into place
    (safetensors issue #782), so a model or adapter saved for other users, a container or a shared cache would be
    unreadable to them."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)
