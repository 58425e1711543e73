"""`multigpu train` as a user runs it: real processes, real files, crashes and restarts."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from multigpu import checkpoint
from multigpu.cli import main
from multigpu.data.activity_data import HAR_CHANNELS
from multigpu.launch import launcher
from tests.dist import multigpu, run_command


def write_uci_har(root: Path, windows: dict[str, int], subjects: dict[str, list[int]], seed: int = 0) -> Path:
    """A small data set in the exact UCI HAR layout, with a learnable signal (the class sets a frequency)."""
    rng = np.random.default_rng(seed)
    time = np.arange(128) / 50.0
    for split, count in windows.items():
        labels = rng.integers(1, 7, size=count)
        signals = root / split / "Inertial Signals"
        signals.mkdir(parents=True)
        for channel, name in enumerate(HAR_CHANNELS):
            rows = [np.sin(2 * np.pi * (label + channel / 9) * time) + 0.3 * rng.normal(size=128) for label in labels]
            np.savetxt(signals / f"{name}_{split}.txt", np.array(rows), fmt="%.5f")
        np.savetxt(root / split / f"y_{split}.txt", labels, fmt="%d")
        np.savetxt(root / split / f"subject_{split}.txt", rng.choice(subjects[split], size=count), fmt="%d")
    return root


@pytest.fixture(scope="module")
def har(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("har") / "UCI HAR Dataset"
    return write_uci_har(root, {"train": 96, "test": 40}, {"train": [1, 3, 5], "test": [2, 4]})


def train_args(har: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(har),
        "--save-dir",
        str(save_dir),
        "--batch-size",
        "8",
        "--epochs",
        "3",
        "--warmup-epochs",
        "1",
        "--lr",
        "3e-3",
        *extra,
    ]


def final_weights(save_dir: Path) -> dict:
    return load_file(save_dir / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(har: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    result = multigpu(*train_args(har, save_dir, "--nproc", "2", "--save-every", "3"), timeout=180)
    assert result.returncode == 0, result.stdout
    return save_dir


def test_trains_on_two_processes_and_writes_metrics_and_a_plain_torch_model(uninterrupted: Path, har: Path) -> None:
    records = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert {"train_loss", "val_accuracy", "samples_per_s", "lr"} <= set(records[0])
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert records[-1]["val_accuracy"] > 0.5  # six classes: chance is 1/6
    assert any((uninterrupted / "tensorboard").iterdir())
    # The export loads with torch and safetensors alone, in a process that never imports multigpu.
    script = f"""
import json, sys, torch
from torch import nn
from safetensors.torch import load_file
config = json.load(open({str(uninterrupted / "model_config.json")!r}))
model = nn.Sequential(*[getattr(nn, name)(*args) for name, *args in config["layers"]])
model.load_state_dict(load_file({str(uninterrupted / "model.safetensors")!r}))
x = torch.ones(1, config["input"]["channels"], config["input"]["window"])
print(repr(model(x).sum().item()), "multigpu" in sys.modules)
"""
    loaded = run_command([sys.executable, "-c", script], timeout=60)
    assert loaded.returncode == 0, loaded.stdout
    assert loaded.stdout.split()[-1] == "False", loaded.stdout
    # ...and equals the model in the last checkpoint.
    last = checkpoint.list_checkpoints(uninterrupted / "checkpoints")[-1]
    assert all(
        (tensor == final_weights(uninterrupted)[name]).all()
        for name, tensor in checkpoint.full_model_state(last).items()
    )


def test_a_crash_with_restarts_ends_with_the_same_model_bitwise(har: Path, uninterrupted: Path, tmp_path: Path) -> None:
    # Started with --resume none, as a new run is: the restart resumes from the run's own newest checkpoint.
    restarts = ("--max-restarts", "1", "--resume", "none")
    result = multigpu(
        *train_args(har, tmp_path, "--nproc", "2", "--save-every", "3", *restarts, "--log-every", "2"),
        env={"MULTIGPU_FAULT": "crash,step=5,rank=1"},
        timeout=180,
    )
    assert result.returncode == 0, result.stdout
    assert "injected crash at step 5 on rank 1" in result.stdout
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000003'} at step 3" in result.stdout, result.stdout
    # The workers record the launch they ran under too, so that --config of this file launches it again.
    ran = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (ran["nproc"], ran["max_restarts"], ran["save_every"], ran["log_every"]) == (2, 1, 3, 2)
    want, got = final_weights(uninterrupted), final_weights(tmp_path)
    assert all((got[name] == want[name]).all() for name in want)
    # The restart resumed mid-epoch (step 3 of 6): that epoch's loss still covers all its samples, and the step
    # counter carried on. Only the summation order differs (rank 0 carries the sum of both ranks' first halves),
    # so the float64 loss agrees to rounding, far below what a lost half-epoch changes.
    records, resumed = metrics(uninterrupted), metrics(tmp_path)
    assert [r["step"] for r in resumed] == [r["step"] for r in records] == [6, 12, 18]
    # The engine's own reports (every 2 steps) carry on from the checkpoint's step 3 after the restart.
    reports = [
        r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "epoch" not in r
    ]
    assert reports == sorted(set(reports)) and reports[-1] == 18  # counted from 0 again, they would end at 14
    for ours, theirs in zip(resumed, records, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-9)
        assert (ours["lr"], ours["val_accuracy"]) == (theirs["lr"], theirs["val_accuracy"])


def metrics(save_dir: Path) -> list[dict]:
    """The per-epoch records of metrics.jsonl (the engine's periodic reports left out)."""
    records = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "epoch" in r]


@pytest.fixture(scope="module")
def killed_in_save(har: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run SIGKILLed while it writes the checkpoint of step 4 (of --save-every 2), mid-epoch (6 steps), after the
    one of step 2: its directory, which the tests below copy before resuming from it."""
    save_dir = tmp_path_factory.mktemp("killed-in-save")
    killed = multigpu(
        *train_args(har, save_dir, "--nproc", "2", "--save-every", "2"),
        env={"MULTIGPU_FAULT": "kill-in-save,step=4"},
        timeout=180,
    )
    assert killed.returncode != 0, killed.stdout
    return save_dir


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(
    har: Path, uninterrupted: Path, killed_in_save: Path, tmp_path: Path
) -> None:
    shutil.copytree(killed_in_save, tmp_path, dirs_exist_ok=True)
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(checkpoints)] == ["step-00000002"]
    assert (checkpoints / ".step-00000004.partial").is_dir()  # the interrupted write, never picked up
    resumed = multigpu(*train_args(har, tmp_path, "--nproc", "2", "--save-every", "2"), timeout=180)
    assert resumed.returncode == 0, resumed.stdout
    assert "resumed from" in resumed.stdout and "step-00000002" in resumed.stdout
    want, got = final_weights(uninterrupted), final_weights(tmp_path)
    assert all((got[name] == want[name]).all() for name in want)


def test_a_resume_at_another_world_size_follows_the_planned_lr_schedule(
    har: Path, uninterrupted: Path, killed_in_save: Path, tmp_path: Path
) -> None:
    """The schedule is over samples: at 3 or 1 processes the resumed run has the lr the 2-process run had at each
    epoch's end (the same sample position, the same arithmetic: equal exactly) and ends at lr 0 with the data. Step
    2 of 2 processes is sample 32, which 3 processes' batches of 24 do not divide."""
    for nproc in ("3", "1"):
        save_dir = tmp_path / f"resumed-at-{nproc}"
        shutil.copytree(killed_in_save, save_dir)
        resumed = multigpu(*train_args(har, save_dir, "--nproc", nproc), timeout=180)
        assert resumed.returncode == 0, resumed.stdout
        assert "resumed from" in resumed.stdout and "step-00000002" in resumed.stdout
        lrs = [r["lr"] for r in metrics(save_dir)]
        assert lrs == [r["lr"] for r in metrics(uninterrupted)]
        assert lrs[-1] == 0.0


# hang: rank 1's main thread sleeps forever after optimizer step 2, its heartbeat posting: named at that exact step,
# its stack where it sleeps. stop: SIGSTOP stops its heartbeat too, whose last post may be up to a beat old (these
# steps take milliseconds, and that post may show a collective it has left): said to be stopped whole at its last
# post; once continued to write its stack, its main thread goes on from where it stopped.
STUCK = [
    ("hang", r"step 2 \(micro-step 2\) and has been outside any collective", "in inject"),
    ("stop", r"step \d \(micro-step \d\) or soon after, its heartbeat stopped too", "its main thread"),
]


@pytest.mark.parametrize(("fault", "where", "stack_says"), STUCK)
def test_a_rank_that_stops_reaching_collectives_is_named_in_one_sentence_its_stack_in_the_log_and_everything_exits(
    har: Path, tmp_path: Path, fault: str, where: str, stack_says: str
) -> None:
    result = multigpu(
        *train_args(har, tmp_path, "--nproc", "2", "--timeout-s", "3"),
        env={"MULTIGPU_FAULT": f"{fault},step=2,rank=1"},
        timeout=90,  # run_command kills the whole group past this: the assertion is that it ended by itself
    )
    assert result.returncode == 1, result.stdout
    # One sentence after the run's own lines: no traceback, no torchrun line; the stuck rank (a stopped one is
    # continued first) wrote its stack to the run's folder.
    stack = tmp_path / "stack-rank1.txt"
    said = result.stdout[result.stdout.index("multigpu run: ") :]
    assert re.fullmatch(
        rf"multigpu run: Rank 1 stopped reaching collectives after optimizer {where} .*, while rank 0 waited in "
        rf"backward \(micro-step 3\) past the 3s timeout: .*; its stack is in {re.escape(str(stack))}\)\. The "
        r"launcher stops every process\.\n",
        said,
    ), result.stdout
    assert "Traceback" not in result.stdout, result.stdout
    assert stack_says in stack.read_text()


def test_export_cli_consolidates_a_checkpoint(uninterrupted: Path, tmp_path: Path) -> None:
    """In this process (`multigpu export` as typed, in a process of its own: the README's, in tests/test_docs.py)."""
    last = checkpoint.list_checkpoints(uninterrupted / "checkpoints")[-1]
    assert main(["export", str(last), str(tmp_path / "out.safetensors")]) == 0
    exported, want = load_file(tmp_path / "out.safetensors"), final_weights(uninterrupted)
    assert set(exported) == set(want) and all((exported[n] == want[n]).all() for n in want)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.safetensors").stat().st_mode) == 0o666 & ~umask  # as any file it writes


def test_export_refuses_an_out_that_exists_or_cannot_be_written_before_reading(
    uninterrupted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def no_reading(*args, **kwargs):
        raise AssertionError("the checkpoint was read before OUT was checked")

    monkeypatch.setattr(checkpoint, "full_model_state", no_reading)
    last = checkpoint.list_checkpoints(uninterrupted / "checkpoints")[-1]
    existing, under_a_file = tmp_path / "model.safetensors", tmp_path / "model.safetensors" / "model.safetensors"
    existing.write_bytes(b"an earlier export")
    refusals = {
        existing: f"OUT {existing} exists already; remove it, or choose another OUT.",
        under_a_file: f"OUT {under_a_file} cannot be created: {existing} is a file; choose another OUT.",
        tmp_path: f"OUT {tmp_path} is a directory; pass a name that does not exist yet, such as {existing}.",
    }
    for out, message in refusals.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(last), str(out)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [f"multigpu: error: {message}"]
    assert existing.read_bytes() == b"an earlier export"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "lstm"], "invalid choice: 'lstm'"),
        (["--batch-size", "0"], "--batch-size must be 1 or more (got 0)"),
        (["--data", "/nonexistent/har"], "--data /nonexistent/har does not exist"),
        (["--resume", "/tmp"], "/tmp is not a multigpu checkpoint"),
        (["--multi-gpu", "zero9"], "invalid choice: 'zero9'"),
    ],
)
def test_bad_input(har: Path, tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(train_args(har, tmp_path / "run", *args))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_gpu_ids_of_gpus_that_are_not_there_are_named_before_anything_starts(
    strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """dp once said "Strategy single runs in one process, but 2 were launched", where nothing was launched."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    monkeypatch.setattr(launcher, "torch_run", lambda args: pytest.fail("workers were started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--multi-gpu", strategy, "--gpu-ids", "0,1", "--save-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "multigpu: error: --gpu-ids 0,1 names GPUs that are not present (this machine has 0: none); choose among "
        "those.\n"
    )


def test_dp_on_the_gpus_named_is_one_process_that_drives_them(
    har: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # launch() writes the environment; a copy keeps that from leaking into other tests.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    monkeypatch.setattr(
        launcher, "torch_run", lambda args: started.append((args.nproc_per_node, os.environ["CUDA_VISIBLE_DEVICES"]))
    )
    assert main(train_args(har, tmp_path / "run", "--multi-gpu", "dp", "--gpu-ids", "1,0")) == 0
    assert started == [("1", "1,0")]


def test_wrong_layout_names_the_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = write_uci_har(tmp_path / "har", {"train": 4, "test": 4}, {"train": [1], "test": [2]})
    (root / "test" / "y_test.txt").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(train_args(root, tmp_path / "run"))
    assert exit_info.value.code == 2
    assert "not in the UCI HAR layout: test/y_test.txt is missing" in capsys.readouterr().err


def test_a_resume_as_another_model_or_optimizer_is_refused_before_anything_starts_and_left_alone(
    har: Path, uninterrupted: Path, capsys: pytest.CaptureFixture
) -> None:
    before = {p.name: p.stat().st_mtime for p in (uninterrupted / "checkpoints").iterdir()}
    for change, run_had in ((["--mode", "flatten"], "conv"), (["--optimizer", "muon"], "adamw")):
        with pytest.raises(SystemExit) as exit_info:
            main(train_args(har, uninterrupted, *change, "--epochs", "5"))
        assert exit_info.value.code == 2
        refused = capsys.readouterr().err
        assert f"{change[0]} {change[1]} differs from {run_had}, which the run that wrote " in refused, refused
        assert f"; pass {change[0]} {run_had}" in refused and refused.endswith("another --save-dir.\n"), refused
    assert {p.name: p.stat().st_mtime for p in (uninterrupted / "checkpoints").iterdir()} == before


def test_resume_none_refuses_to_overwrite_another_run(har: Path, uninterrupted: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(train_args(har, uninterrupted, "--resume", "none"))
    assert exit_info.value.code == 2
    assert "already holds checkpoints of another run" in capsys.readouterr().err


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(
    har: Path, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shutil.copytree(uninterrupted / "checkpoints", tmp_path / "checkpoints")
    before, newest = checkpoint.list_checkpoints(tmp_path / "checkpoints")[-2:]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = multigpu(*train_args(har, tmp_path, "--nproc", "2", "--epochs", "4"), timeout=180)
    assert result.returncode == 0, result.stdout
    assert f"passed over damaged checkpoint(s) {newest.name} (its shard" in result.stdout
    assert f"resumed from {before}" in result.stdout
    assert "Traceback" not in result.stdout
    # Every checkpoint damaged: one sentence and exit 2, before any process starts, and nothing moved.
    for path in checkpoint.list_checkpoints(tmp_path / "checkpoints"):
        (path / "objects.pt").write_bytes(b"")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(train_args(har, tmp_path, "--nproc", "2", "--epochs", "5"))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "can be loaded (step-" in error and "cannot be read" in error


def test_a_full_disk_during_a_save_stops_with_one_sentence_and_keeps_the_last_checkpoint(
    har: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    """A real refusal by the kernel: rank 1 may write no file past 64 KiB from the save of step 4 on, so its small
    files are written and its shard fails inside DCP's writer (in the background), which shares the failure with
    rank 0 only as a pickle (without the OSError behind torch.save's RuntimeError)."""
    args = train_args(har, tmp_path, "--nproc", "2", "--save-every", "2", "--async-save")
    full = multigpu(*args, env={"MULTIGPU_FAULT": "disk-full,step=4,rank=1,bytes=65536"}, timeout=180)
    assert full.returncode == 2, full.stdout
    errors = [line for line in full.stdout.splitlines() if line.startswith("multigpu: error:")]
    assert len(errors) == 1 and "Traceback" not in full.stdout  # said once, by rank 0, for every rank
    assert "Could not write the checkpoint step-00000004" in errors[0] and "on rank 1: File too large" in errors[0]
    assert f"the last complete checkpoint, {tmp_path / 'checkpoints' / 'step-00000002'}, is intact" in errors[0]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]  # the partial one removed
    resumed = multigpu(*args, timeout=180)
    assert resumed.returncode == 0, resumed.stdout
    want, got = final_weights(uninterrupted), final_weights(tmp_path)
    assert all((got[name] == want[name]).all() for name in want)


def test_a_save_dir_that_cannot_be_written_is_refused_before_training(
    har: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(train_args(har, tmp_path / "a-file" / "run"))
    assert exit_info.value.code == 2
    assert f"--save-dir {tmp_path / 'a-file' / 'run'} cannot be created: {tmp_path / 'a-file'} is a file" in (
        capsys.readouterr().err
    )
    locked = tmp_path / "read-only"
    locked.mkdir(mode=0o500)
    try:
        (locked / "probe").touch()
        pytest.skip("this user writes into read-only directories (root): the a-file case above still ran")
    except PermissionError:
        pass
    with pytest.raises(SystemExit) as exit_info:
        main(train_args(har, locked / "run"))
    assert exit_info.value.code == 2
    assert f"--save-dir {locked / 'run'} is not writable (Permission denied in {locked})" in capsys.readouterr().err
