"""Where metrics go: one JSON line per record, and TensorBoard, from the main process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where metrics are written

        directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = (directory / "metrics.jsonl").open("a")
        self._tensorboard = SummaryWriter(str(directory / "tensorboard"))

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tensorboard.add_scalar(key, value, step)
        self._tensorboard.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._tensorboard.close()


def peak_memory_bytes(device: Any) -> int:
    """The allocator's peak on a GPU; the process's peak resident memory on CPU."""
    import resource

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
