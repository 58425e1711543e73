"""Results written whole or not at all: a disk's refusal leaves nothing under the final name, and says so in one
sentence."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from multigpu.core import atomic, faults
from multigpu.core.errors import UsageError

RUN_RESULT = "free space, then run the same command again."


def test_a_directory_the_disk_refuses_leaves_the_one_before_and_one_sentence(tmp_path: Path) -> None:
    target = tmp_path / "model"
    atomic.write_dir(target, lambda d: (d / "config.json").write_text("old"), RUN_RESULT)

    def full(directory: Path) -> None:
        (directory / "config.json").write_text("new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UsageError) as refused:
        atomic.write_dir(target, full, RUN_RESULT)
    assert str(refused.value).startswith(f"Could not write {target}: No space left on device; free space")
    assert str(refused.value).count(". ") == 0  # one sentence
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no .model.partial left
    assert (target / "config.json").read_text() == "old"
    atomic.write_dir(target, lambda d: (d / "config.json").write_text("new"), RUN_RESULT)
    assert (target / "config.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_safetensors_file_past_the_file_size_limit_is_one_sentence_and_absent(tmp_path: Path) -> None:
    """safetensors' writer keeps the OS's refusal in its text only: still one sentence, still nothing written."""
    out = tmp_path / "model.safetensors"
    before = faults.limit_file_size(4096)
    try:
        with pytest.raises(UsageError, match=f"Could not write {out}: File too large; "):
            atomic.write_file(out, lambda partial: save_file({"w": torch.zeros(10_000)}, partial), RUN_RESULT)
    finally:
        faults.limit_file_size(before)
    assert not any(tmp_path.iterdir())
    atomic.write_file(out, lambda partial: save_file({"w": torch.ones(10_000)}, partial), RUN_RESULT)
    assert load_file(out)["w"].sum() == 10_000


def test_an_interrupt_is_found_behind_the_errors_that_wrap_it() -> None:
    """Ctrl-C inside a DCP write: the file being written fails on its way out, and DCP wraps that failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("unexpected pos 704 vs 598")  # what torch.save's zip writer raised on its way out
    except RuntimeError as failure:
        wrapped = CheckpointException("write", {0: (failure, None)})
    found = list(atomic.causes(wrapped))
    assert any(isinstance(e, KeyboardInterrupt) for e in found) and atomic.disk_error(wrapped) is None
    disk = CheckpointException("write", {1: (OSError(28, "No space left on device"), None)})
    assert atomic.disk_error(disk).strerror == "No space left on device"
