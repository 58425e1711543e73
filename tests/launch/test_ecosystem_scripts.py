"""The ecosystem's own scripts under `multigpu run -n 2`, unchanged, with both processes really cooperating.

Each script in tests/scripts writes OUTDIR/rank{RANK}.json: the world size and rank its library reported, the
sample indices it trained on (32 samples, 2 epochs) and its parameters before and after training.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from multigpu.core.ports import free_port
from tests.dist import multigpu, run_command, run_reference

SCRIPTS = Path(__file__).parents[1] / "scripts"
SAMPLES, EPOCHS = 32, 2
ON_CPU = torch.cuda.device_count() == 0


def records(outdir: Path) -> list[dict]:
    return [json.loads((outdir / f"rank{rank}.json").read_text()) for rank in range(2)]


def epochs(samples: list[int]) -> list[list[int]]:
    """A rank's sample indices cut into its epochs."""
    per_epoch = len(samples) // EPOCHS
    return [samples[i * per_epoch : (i + 1) * per_epoch] for i in range(EPOCHS)]


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="2 processes need 2 GPUs, or none")
@pytest.mark.parametrize(
    "script", ["plain_torch_distributed.py", "hf_trainer.py", "accelerate_script.py", "lightning_script.py"]
)
def test_script_trains_in_two_cooperating_processes(script: str, tmp_path: Path) -> None:
    result = multigpu("run", "-n", "2", str(SCRIPTS / script), str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout
    first, second = records(tmp_path)

    assert [first["world_size"], second["world_size"]] == [2, 2], result.stdout
    assert [first["rank"], second["rank"]] == [0, 1]
    assert [first.get("torch_world_size", 2), second.get("torch_world_size", 2)] == [2, 2]
    # The data is split: in every epoch the two ranks trained on disjoint halves that together cover it all.
    for mine, theirs in zip(epochs(first["samples"]), epochs(second["samples"]), strict=True):
        assert len(mine) == len(theirs) == SAMPLES // 2
        assert set(mine).isdisjoint(theirs) and set(mine) | set(theirs) == set(range(SAMPLES))
    # Different data yet the same parameters: gradients were averaged across the ranks, and training moved them.
    assert first["initial"] == second["initial"]
    assert first["final"] == second["final"]
    assert first["final"] != first["initial"]


@pytest.mark.skipif(not ON_CPU, reason="accelerate's CPU fallback only happens without CUDA GPUs")
def test_without_accelerate_use_cpu_each_rank_would_train_alone(tmp_path: Path) -> None:
    """Why `multigpu run` sets ACCELERATE_USE_CPU=true on CPU: plain torchrun without it gets 2 lone trainers.

    Should accelerate ever stop falling back silently, this fails and the setting in launch.py can go.
    """
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d"]
    argv += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPTS / "accelerate_script.py"), str(tmp_path)]
    result = run_command(argv, timeout=180, env={"ACCELERATE_USE_CPU": "false"})
    assert result.returncode == 0, result.stdout
    for record in records(tmp_path):
        assert record["torch_world_size"] == 2  # a process group of 2 exists...
        assert record["world_size"] == 1 and record["rank"] == 0  # ...but accelerate runs each rank alone
        assert all(sorted(epoch) == list(range(SAMPLES)) for epoch in epochs(record["samples"]))


@pytest.mark.skipif(not ON_CPU, reason="the refusal only applies without CUDA GPUs")
def test_accelerate_use_cpu_forced_false_on_cpu_is_refused(tmp_path: Path) -> None:
    script = SCRIPTS / "accelerate_script.py"
    result = multigpu("run", "-n", "2", str(script), str(tmp_path), timeout=60, env={"ACCELERATE_USE_CPU": "false"})
    assert result.returncode == 2, result.stdout
    assert (
        "ACCELERATE_USE_CPU=false on a machine without CUDA GPUs makes accelerate and HF Trainer train each of the "
        "2 processes alone" in result.stdout
    )
    assert not list(tmp_path.iterdir())  # refused before any worker started


NANOGPT = Path(__file__).parents[2] / "docs" / "examples" / "nanogpt_train.py"


def val_losses(output: str) -> dict[int, float]:
    """The nanoGPT-shaped script's `step N: train loss X, val loss Y` lines, by step."""
    found = re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)$", output, flags=re.MULTILINE)
    return {int(step): float(loss) for step, loss in found}


def test_a_nanogpt_shaped_script_trains_under_zero3_and_resumes_exactly_at_another_world_size(tmp_path: Path) -> None:
    """The porting guide's example, as a user runs it: zero3 on 2 processes over its tied GPT-2-shaped model (which
    crashed before the tie was kept in one FSDP unit), evaluation and checkpoints on every rank; a run that dies at
    step 4 resumes from its step-3 checkpoint on 1 process under ddp and ends where the uninterrupted run ends. The
    random windows depend on the global sample index only and the global batch is fixed, so only the order of
    additions differs between 2 processes and 1 (fp32: ~1e-7 relative); a resume that re-read other windows, or
    restarted the lr schedule, misses by 1e-3 or more."""
    script = ["run", "-n", "2", str(NANOGPT), "--strategy", "zero3", "--max-iters", "6", "--eval-interval", "3"]
    # The uninterrupted run, only compared with: the same 2 ranks and sums, without a launch's fresh interpreters
    # (the crashed run below is the example launched as a user launches it, up to its step-3 evaluation).
    whole = run_reference(str(NANOGPT), [*script[4:], "--out-dir", str(tmp_path / "whole")], timeout=180)
    crashed = multigpu(*script, "--out-dir", str(tmp_path / "crashed"), env={"MULTIGPU_FAULT": "crash,step=4,rank=1"})
    assert crashed.returncode != 0 and 3 in val_losses(crashed.stdout), crashed.stdout
    # A crash is said as one: the survivor whose collective it broke does not call it ranks gone different ways.
    assert "injected crash at step 4" in crashed.stdout and "went different ways" not in crashed.stdout
    resumed = multigpu(
        "run", "-n", "1", str(NANOGPT), "--strategy", "ddp", "--max-iters", "6", "--eval-interval", "3",
        "--out-dir", str(tmp_path / "crashed"), "--init-from", "resume", timeout=180,
    )  # fmt: skip
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout and "at iter 3" in resumed.stdout, (
        resumed.stdout
    )
    expected, got = val_losses(whole), val_losses(resumed.stdout)
    assert list(got) == [6] and got[6] == pytest.approx(expected[6], rel=1e-5), (expected, got)
    assert abs(expected[6] - expected[3]) > 1e-2  # training moved the loss far past the tolerance
