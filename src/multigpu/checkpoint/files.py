"""What a checkpoint directory holds, which rank writes each part, and reading a part back as plain data only.

A checkpoint is a directory:
  .metadata, __*_*.distcp   model and optimizer tensors, each rank writing its own shards (DCP)
  objects.pt                everything else in the state (schedulers, the loader's position, counters), rank 0
  rng-rank<R>.pt            each rank's random number generator states
  communication-rank<R>.pt  each rank's gradient compression state (ddp's PowerSGD), when it keeps one
Loading builds only tensors and plain data (torch.load's weights_only), so a checkpoint from someone else cannot run
code.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multigpu.core.atomic import disk_errors_raised
from multigpu.core.errors import UsageError

OBJECTS, METADATA = "objects.pt", ".metadata"
RNG = "rng-rank{rank}.pt"
COMMUNICATION = "communication-rank{rank}.pt"


def grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def this_rank() -> int:
    return dist.get_rank() if grouped() else 0


def barrier() -> None:
    if grouped():
        dist.barrier()


def save_synced(obj: Any, file: Path) -> None:
    # Through a file object of ours: given a path, torch.save writes with C++ streams, whose failure says only
    # "basic_ios::clear: iostream error", without the OS's reason.
    with disk_errors_raised(), open(file, "wb") as stream:
        torch.save(obj, stream)
        stream.flush()
        os.fsync(stream.fileno())


def load_data(file: Path) -> Any:
    """torch.load restricted to tensors and plain data; a refused global becomes a sentence that says what to do."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as refusal:
        refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        if not refused:
            raise  # damaged rather than refused: torch's own message says more
        raise UsageError(
            f"{file} holds {', '.join(refused)}, which loading refuses to build because unpickling could run code; "
            "if you trust the file, allow-list the types with torch.serialization.add_safe_globals before loading."
        ) from refusal
