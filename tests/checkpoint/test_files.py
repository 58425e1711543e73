"""A checkpoint's parts read back as tensors and plain data only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import multigpu as mg
from multigpu import checkpoint
from tests.checkpoint.test_checkpoint import single_engine_state


class CreatesAFile:
    """A pickle that runs code when loaded: what a checkpoint from a stranger may hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    path = engine.save(tmp_path / "step-3", state)
    marker = tmp_path / "code-ran"
    torch.save(CreatesAFile(marker), path / checkpoint.OBJECTS)
    with pytest.raises(
        mg.UsageError, match=r"objects\.pt holds .*pathlib\.Path\b.*if you trust the file.*add_safe_globals"
    ):
        engine.load(path, state)
    assert not marker.exists()
