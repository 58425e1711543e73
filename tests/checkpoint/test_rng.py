"""Each rank's random number generators saved and restored with its checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from tests.checkpoint.test_checkpoint import single_engine_state


def test_rng_files_written_by_earlier_versions_still_load(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    path = engine.save(tmp_path / "step-3", state)
    old_style = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(old_style, path / "rng-rank0.pt")
    numpy_next, python_next = np.random.rand(3), random.random()
    np.random.seed(7)
    random.seed(7)
    engine.load(path, state)
    assert np.array_equal(np.random.rand(3), numpy_next)
    assert random.random() == python_next
