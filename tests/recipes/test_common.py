"""What the recipes share: where a run (and a restart of its workers) resumes from."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import multigpu as mg
from multigpu.core.launcher_notes import LAST_CHECKPOINT, LAUNCHER_DIR
from multigpu.recipes.common import resolve_resume
from tests.checkpoint.test_checkpoint import single_engine_state


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


def test_a_second_run_on_a_live_save_dir_is_refused_and_a_killed_ones_is_free(tmp_path: Path) -> None:
    """The lock is the first run's process's flock: named in the refusal while it lives, gone once it is killed."""
    from tests.dist import multigpu, refusal, running
    from tests.recipes.test_finetune import write_text

    args = ["finetune", "--model", "tiny", "--data", write_text(tmp_path / "text.txt"), "--seq-len", "32"]
    args += ["--batch-size", "2", "--log-every", "0", "--save-dir", str(tmp_path / "run")]
    lock = tmp_path / "run" / ".run.lock"
    with running(*args, "--max-steps", "100000") as first:
        deadline = time.monotonic() + 60
        while not (lock.is_file() and lock.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        printed = refusal(*args, "--max-steps", "2")
        assert printed.count("\n") == 1 and f"is in use by another run (pid {first.pid} on host" in printed, printed
        first.kill()  # kill -9: no clean-up of its own
        first.wait()
    second = multigpu(*args, "--max-steps", "2", timeout=180)
    assert second.returncode == 0 and "step 2: validation loss" in second.stdout, second.stdout
    assert not lock.exists()
