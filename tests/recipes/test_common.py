"""What the recipes share: where a run (and a restart of its workers) resumes from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import multigpu as mg
from multigpu.core.notes import LAST_CHECKPOINT, LAUNCHER_DIR
from multigpu.recipes.common import resolve_resume
from tests.engine.test_checkpoint import single_engine_state


@dataclass
class Run:
    save_dir: str
    resume: str


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A save dir whose run committed step-1 and step-2, and a checkpoint elsewhere (a --resume PATH)."""
    engine, state = single_engine_state(tmp_path)
    for step in (1, 2):
        engine.save(tmp_path / "run" / "checkpoints" / f"step-{step}", state)
    engine.save(tmp_path / "elsewhere" / "step-9", state)
    return tmp_path


def as_worker(monkeypatch: pytest.MonkeyPatch, notes: Path | None, restart: int) -> None:
    """This process as a worker of attempt `restart`, of `multigpu run` when `notes` is its launcher's folder."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    if notes is None:
        monkeypatch.delenv(LAUNCHER_DIR, raising=False)
    else:
        notes.mkdir(exist_ok=True)
        monkeypatch.setenv(LAUNCHER_DIR, str(notes))


def test_a_restart_resumes_from_the_runs_newest_checkpoint_whatever_the_start_was_told(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_dir, notes, elsewhere = run_dir / "run", run_dir / "notes", run_dir / "elsewhere" / "step-9"
    newest = save_dir / "checkpoints" / "step-2"
    as_worker(monkeypatch, notes, restart=0)  # the first start does as it was told
    assert resolve_resume(Run(str(save_dir), str(elsewhere))) == elsewhere
    with pytest.raises(mg.UsageError, match="already holds checkpoints of another run"):
        resolve_resume(Run(str(save_dir), "none"))
    # The run committed step-2 (the launcher's note), then a worker crashed: every restart goes on from step-2.
    (notes / LAST_CHECKPOINT).write_text(str(newest.resolve()))
    as_worker(monkeypatch, notes, restart=1)
    for resume in ("none", "auto", str(elsewhere)):
        assert resolve_resume(Run(str(save_dir), resume)) == newest.resolve(), resume
    # Before its first checkpoint a restart starts as the first start did ('none': from nothing, not refused).
    (notes / LAST_CHECKPOINT).unlink()
    assert resolve_resume(Run(str(run_dir / "fresh"), "none")) is None
    assert resolve_resume(Run(str(run_dir / "fresh"), str(elsewhere))) == elsewhere
    # Under another launcher (no notes), the newest whole checkpoint in the save dir.
    as_worker(monkeypatch, None, restart=1)
    assert resolve_resume(Run(str(save_dir), str(elsewhere))) == newest
