"""Checkpoints written whole or not at all: every file synced before the rename, the old one kept through a crash,
a disk's refusal one sentence on every rank with the last checkpoint intact."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest

import multigpu as mg
from multigpu import checkpoint
from multigpu.core import atomic, faults
from tests.checkpoint.test_checkpoint import single_engine_state


def test_every_file_is_on_disk_before_the_rename_makes_the_checkpoint_exist(tmp_path: Path, monkeypatch) -> None:
    # Files are known by inode rather than name: DCP syncs .metadata under a temporary name, then renames it.
    events: list[tuple[str, tuple[int, int], str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced = os.fstat(fd)
        events.append(("fsync", (synced.st_dev, synced.st_ino), os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source: str | Path, target: str | Path) -> None:
        moved = os.stat(source)
        events.append(("replace", (moved.st_dev, moved.st_ino), f"{source} -> {target}"))
        real_replace(source, target)

    engine, state = single_engine_state(tmp_path)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = engine.save(tmp_path / "step-3", state)
    monkeypatch.undo()

    def inode(of: Path) -> tuple[int, int]:
        return os.stat(of).st_dev, os.stat(of).st_ino

    rename = next(i for i, (kind, what, _) in enumerate(events) if kind == "replace" and what == inode(path))
    synced_at = {what: i for i, (kind, what, _) in enumerate(events[:rename]) if kind == "fsync"}
    names = [name for _, _, name in events]
    files = sorted(path.iterdir())
    assert {checkpoint.OBJECTS, checkpoint.METADATA, "rng-rank0.pt"} <= {file.name for file in files}
    for file in files:
        assert inode(file) in synced_at, f"{file.name} was not synced before the rename: {names}"
    last_file = max(synced_at[inode(file)] for file in files)
    assert synced_at.get(inode(path), -1) > last_file, f"the directory was not synced after its files: {names}"
    synced_after = [what for kind, what, _ in events[rename + 1 :] if kind == "fsync"]
    assert inode(tmp_path) in synced_after, f"the rename itself was not synced: {names}"


def test_a_crash_while_replacing_a_checkpoint_keeps_the_old_one(tmp_path: Path, monkeypatch) -> None:
    engine, state = single_engine_state(tmp_path)
    path = engine.save(tmp_path / "step-3", state)
    real_replace = os.replace

    def power_loss_at_the_rename(source: str | Path, target: str | Path) -> None:
        if Path(source) == atomic.partial_path(path):
            raise OSError("power loss")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", power_loss_at_the_rename)
    with pytest.raises(OSError, match="power loss"):
        engine.save(path, {**state, "step": 4})
    monkeypatch.undo()
    kept = [old for old in tmp_path.iterdir() if old != atomic.partial_path(path) and old.is_dir()]
    assert len(kept) == 1, f"the old checkpoint is gone: {sorted(tmp_path.iterdir())}"
    _, fresh = single_engine_state(tmp_path)
    engine.load(kept[0], fresh)
    assert fresh["step"] == 3


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes of a file fail in this process, as on a full disk (EFBIG rather than ENOSPC)."""
    before = faults.limit_file_size(limit)
    try:
        yield
    finally:
        faults.limit_file_size(before)


@pytest.mark.parametrize(
    ("limit", "async_save"),
    [(8 << 10, False), (64 << 10, False), (64 << 10, True)],
    ids=["rng-file", "shard", "shard-in-background"],  # rng-rank0.pt is 14 KiB, the shard 200 KiB
)
def test_a_write_the_disk_refuses_ends_in_one_sentence_and_keeps_the_last_checkpoint(
    tmp_path: Path, limit: int, async_save: bool, caplog: pytest.LogCaptureFixture
) -> None:
    engine, state = single_engine_state(tmp_path, hidden=4096)
    engine.save(tmp_path / "step-1", state)
    with file_size_limit(limit), pytest.raises(mg.UsageError) as refusal:
        engine.save(tmp_path / "step-2", state, async_save=async_save)
        engine.wait_for_checkpoint()
    assert re.fullmatch(
        f"Could not write the checkpoint step-2 in {tmp_path}: File too large; the last complete checkpoint, "
        f"{tmp_path / 'step-1'}, is intact\\. Free space .*",
        str(refusal.value),
    )
    assert [p.name for p in tmp_path.iterdir()] == ["step-1"]  # the partial one removed
    # ...and said once: not also logged, with a traceback, from the thread that finished the background write.
    assert not [record.getMessage() for record in caplog.records if record.name == "concurrent.futures"]
    engine.load(tmp_path / "step-1", state)
