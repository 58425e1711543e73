"""Bad input: one clear sentence and exit code 2, before any process starts."""

from __future__ import annotations

import pytest

from multigpu.cli import main
from tests.dist import multigpu


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "fsdp3"], "invalid choice: 'fsdp3'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--grad-accum-steps", "0"], "grad_accum_steps must be 1 or more (got 0)."),
        (["--backend", "nccl"], "The nccl backend needs CUDA GPUs"),
        (["--strategy", "single"], "Strategy single runs in one process, but 2 were launched"),
        (["--strategy", "ddp", "--cpu-offload"], "cpu_offload works with strategy zero3 only"),
        (["--strategy", "zero3", "--cpu-offload"], "this run is on CPU already"),
        (["--max-grad-norm", "-1"], "max_grad_norm must be positive"),
    ],
)
def test_bad_demo_input(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) <= 3  # one sentence (argparse adds its usage line first)


def test_usage_error_exits_2_from_the_installed_command() -> None:
    result = multigpu("demo", "--grad-accum-steps", "0")
    assert result.returncode == 2
    assert result.stdout.strip() == "multigpu: error: grad_accum_steps must be 1 or more (got 0)."


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--strategy",
        "--precision",
        "--grad-accum-steps",
        "--max-grad-norm",
        "--seed",
        "--cpu-offload",
        "--backend",
        "--timeout-s",
        "--epochs",
        "--batch-size",
        "--lr",
        "--nproc",
    ):
        assert flag in out


def test_demo_trains_on_two_processes() -> None:
    result = multigpu("demo", "--nproc", "2", "--epochs", "3", "--strategy", "zero2", timeout=120)
    assert result.returncode == 0, result.stdout
    assert "strategy zero2, precision 32, 2 process(es)" in result.stdout
    assert "(1024 samples)" in result.stdout  # validation gathered whole, without padding duplicates
    assert "epoch 3/3" in result.stdout
