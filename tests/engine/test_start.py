"""What the Engine refuses before any process starts (engine/start.py), where the machine's GPUs decide it."""

from __future__ import annotations

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.engine import start
from multigpu.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("settings", "needs"),
    [
        ({"strategy": "zero3"}, "strategy zero3"),
        ({"strategy": "tp"}, "strategy tp with tp_size 2"),
        ({"strategy": "pp"}, "strategy pp with pp_size 2"),
        ({"strategy": "ddp", "ep_size": 2}, "ep_size 2"),
    ],
)
def test_processes_sharing_a_gpu_refuse_what_gloo_cannot_run_on_cuda(
    monkeypatch: pytest.MonkeyPatch, settings: dict, needs: str
) -> None:
    """Measured on an H200: gloo's all-gather crashes on CUDA tensors and its sends abort; its all-reduce,
    broadcast and all-to-all run (GPU counts mocked: this runs without a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=rf"^2 processes sharing 1 GPU\(s\) talk over gloo, .*, and {needs} needs"):
        start.check(EngineConfig(**settings), 2)
    for strategy in ("ddp", "zero1"):
        start.check(EngineConfig(strategy=strategy, cp_size=2, batch_shares="3,1"), 4)
    start.check(EngineConfig(strategy="zero3"), 1)  # one process: nothing shared
