"""Reading a sharded checkpoint's model whole in one process, without any process group: what `multigpu export`
writes out (as safetensors, or as a LoRA adapter)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from multigpu.checkpoint.finding import check_checkpoint
from multigpu.core.errors import UsageError


def model_metadata(checkpoint: Path, key: str = "model") -> dict[str, Any]:
    """`key`'s tensors in a checkpoint, by name within `key`: their metadata (`.size`, `.properties.dtype`),
    read without any tensor."""
    import torch.distributed.checkpoint as dcp

    check_checkpoint(checkpoint)
    metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    prefix = f"{key}."
    found = {
        name.removeprefix(prefix): meta
        for name, meta in metadata.items()
        if name.startswith(prefix) and hasattr(meta, "size")
    }
    if not found:
        raise UsageError(f"The checkpoint {checkpoint} holds no {key!r} tensors; name the model's key in the state.")
    return found


def full_model_state(
    checkpoint: Path, key: str = "model", names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """One process reads the whole of `key` (or of its tensors `names`) from a sharded checkpoint (the
    consolidation for export)."""
    import torch.distributed.checkpoint as dcp

    stored = model_metadata(checkpoint, key)
    wanted = {
        f"{key}.{name}": torch.empty(tuple(stored[name].size), dtype=stored[name].properties.dtype)
        for name in (stored if names is None else names)
    }
    with warnings.catch_warnings():  # no_dist=True says so already
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, checkpoint_id=checkpoint, no_dist=True)
    return {name.removeprefix(f"{key}."): tensor for name, tensor in wanted.items()}
