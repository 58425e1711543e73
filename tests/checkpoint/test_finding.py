"""Finding checkpoints: partial and old ones never picked, a damaged newest one passed over and moved aside, a path
that is no checkpoint refused in one sentence."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest

import multigpu as mg
from multigpu import checkpoint
from tests.checkpoint.test_checkpoint import single_engine_state


def test_partial_and_old_checkpoints_are_never_picked(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    for step in (1, 2, 3, 4):
        engine.save(tmp_path / f"step-{step}", state, keep_last=2)
    (tmp_path / ".step-5.partial").mkdir()  # what a crash during a save leaves behind
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-3", "step-4"]


def test_loading_something_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    with pytest.raises(mg.UsageError, match="is not a multigpu checkpoint"):
        engine.load(tmp_path, state)


def damage_shard(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # a copy cut short, or a disk that filled


@pytest.mark.parametrize(
    ("harm", "reason"),
    [
        (damage_shard, r"its shard __0_0.distcp is truncated \(\d+ of \d+ bytes\)"),
        (lambda path: next(path.glob("*.distcp")).unlink(), "its shard __0_0.distcp is missing"),
        (lambda path: (path / ".metadata").write_bytes(b"\x80garbage"), "its .metadata cannot be read"),
        (lambda path: (path / "objects.pt").write_bytes(b"PK\x03\x04cut"), "its objects.pt cannot be read"),
        (lambda path: (path / "rng-rank0.pt").write_bytes(b""), "its rng-rank0.pt cannot be read"),
    ],
)
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(tmp_path: Path, harm, reason: str) -> None:
    engine, state = single_engine_state(tmp_path)
    for step in (1, 2):
        engine.save(tmp_path / f"step-{step}", state)
    harm(tmp_path / "step-2")
    said: list[str] = []
    assert checkpoint.newest_usable(tmp_path, said.append) == tmp_path / "step-1"
    assert len(said) == 1 and re.search(f"step-2 \\({reason}.*using step-1", said[0])
    # Kept for inspection, out of the way: later runs neither pick it nor prune good checkpoints in its favour.
    assert (tmp_path / ".step-2.damaged").is_dir() and checkpoint.list_checkpoints(tmp_path) == [tmp_path / "step-1"]
    with pytest.raises(mg.UsageError, match=f"The checkpoint .*step-2.damaged is damaged: {reason}"):
        engine.load(tmp_path / ".step-2.damaged", state)
    engine.load(tmp_path / "step-1", state)


def test_a_step_damaged_twice_is_kept_under_a_second_name_and_the_good_one_before_it_survives(tmp_path: Path) -> None:
    """A damaged copy of step 3 is kept already when step 3, written again, is damaged again: the second copy goes
    to a new name (a move onto the first would fail), and saving on never prunes the good step 2 for it."""
    engine, state = single_engine_state(tmp_path)
    for step in (1, 2, 3):
        engine.save(tmp_path / f"step-{step}", state)
    (tmp_path / ".step-3.damaged").mkdir()
    (tmp_path / ".step-3.damaged" / "first").write_text("the first damaged copy")
    damage_shard(tmp_path / "step-3")
    said: list[str] = []
    assert checkpoint.newest_usable(tmp_path, said.append) == tmp_path / "step-2"
    assert said[0].endswith("kept as .step-3.damaged-2; using step-2")
    assert (tmp_path / ".step-3.damaged" / "first").exists() and (tmp_path / ".step-3.damaged-2").is_dir()
    engine.save(tmp_path / "step-4", state, keep_last=1)
    assert checkpoint.list_checkpoints(tmp_path) == [tmp_path / "step-4"]


def test_a_damaged_checkpoint_that_cannot_be_moved_is_refused(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    for step in (1, 2):
        engine.save(tmp_path / f"step-{step}", state)
    damage_shard(tmp_path / "step-2")
    with (
        mock.patch("os.replace", side_effect=PermissionError(13, "Permission denied")),
        pytest.raises(mg.UsageError, match=r"The damaged checkpoint .*step-2 could not be moved aside to "),
    ):
        checkpoint.newest_usable(tmp_path, print)


def test_pruning_keeps_checkpoints_of_later_steps_and_the_one_just_written(tmp_path: Path) -> None:
    """A run resumed from step 1 below an unread (maybe damaged) step 3 writes step 2 with keep_last=1: step 3 is
    not counted, so step 2 stays (before, step 2 itself was pruned in its favour) and only step 1 goes."""
    engine, state = single_engine_state(tmp_path)
    for step in (1, 3, 2):
        engine.save(tmp_path / f"step-{step}", state, keep_last=1 if step == 2 else None)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-2", "step-3"]


def test_when_no_checkpoint_is_usable_resume_refuses_and_moves_nothing(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    for step in (1, 2):
        engine.save(tmp_path / f"step-{step}", state)
        damage_shard(tmp_path / f"step-{step}")
    with pytest.raises(mg.UsageError, match=r"None of the 2 checkpoint\(s\) in .* can be loaded \(step-2: its shard"):
        checkpoint.newest_usable(tmp_path, print)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-1", "step-2"]


def test_a_file_given_as_a_checkpoint_is_named_as_a_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(mg.UsageError, match=r"model\.safetensors is a file, but a checkpoint is a directory"):
        checkpoint.check_checkpoint(tmp_path / "model.safetensors")
    with pytest.raises(mg.UsageError, match="absent does not exist; pass a checkpoint directory"):
        checkpoint.check_checkpoint(tmp_path / "absent")
