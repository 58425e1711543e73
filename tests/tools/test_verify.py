"""`multigpu verify` passes correct scripts under every strategy and fails the classic mistakes at step 1."""

import json

import pytest

from tests.dist import multigpu

SCRIPT = "tests/scripts/next_token.py"


def verify(*flags: str, bug: str = "none") -> tuple[int, dict]:
    result = multigpu("verify", "--json", "--steps", "4", *flags, SCRIPT, "--bug", bug, timeout=240)
    assert result.returncode in (0, 1), result.stdout
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    return result.returncode, report


@pytest.mark.parametrize("strategy", ["zero1", "deepspeed", "tp", "pp"])
def test_passes_a_correct_script(strategy: str) -> None:
    """Under tp and pp the two processes share each batch: the reference accumulates 1 batch per step, not 2.
    (ddp, zero2 and zero3 pass it below, with the per-process batch taken from a fixed global batch.)"""
    code, report = verify("--strategy", strategy)
    assert code == 0 and report["passed"], report
    assert report["strategy"] == strategy and [s["step"] for s in report["steps"]] == [1, 2, 3, 4]
    assert report["first_divergence"] is None and report["initial_param_diff"] == 0
    assert max(s["relative_diff"] for s in report["steps"]) <= 1e-4


def test_passes_bf16_mixed_with_its_tolerance() -> None:
    code, report = verify("--strategy", "zero2", "--precision", "bf16-mixed")
    assert code == 0 and report["passed"] and report["loss_tolerance"] == 3e-2, report


@pytest.mark.parametrize("bug", ["dropout", "token-mean"])
def test_fails_per_rank_randomness_and_per_rank_token_means(bug: str) -> None:
    code, report = verify("--strategy", "ddp", bug=bug)
    assert code == 1 and not report["passed"]
    assert report["first_divergence"] == 1 and report["reason"] == "the loss diverged at step 1"
    assert report["steps"][0]["relative_diff"] > 5 * report["loss_tolerance"]
    # Only what verify saw is blamed: the dropout module; a token mean it cannot see, and says so.
    assert "both runs' first step read the same samples" in report["checked"]
    if bug == "dropout":
        assert [cause.split(" (")[0] for cause in report["causes"]] == ["the model has dropout"]
    else:
        assert report["causes"] == [] and "no BatchNorm or dropout" in " ".join(report["checked"])
        assert any("engine.backward got no count=" in blind for blind in report["unchecked"])


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_passes_a_script_that_fixes_the_global_batch(strategy: str) -> None:
    """batch = global // world_size: one process reads 8 samples a micro-step, so its reference accumulates 1."""
    result = multigpu(
        "verify", "--json", "--steps", "3", "--strategy", strategy, SCRIPT, "--global-batch", "8", timeout=240
    )
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert result.returncode == 0 and report["passed"], report
    assert report["samples_per_step"] == 8 and report["reference_grad_accum"] == 1
    assert max(s["relative_diff"] for s in report["steps"]) <= 1e-4


def test_fails_a_dataloader_that_every_rank_reads_whole() -> None:
    code, report = verify("--strategy", "ddp", bug="plain-loader")
    assert code == 1 and report["first_divergence"] == 1
    assert len(report["causes"]) == 1 and report["causes"][0].startswith("every process read the same samples")


def test_dp_without_gpus_is_one_sentence() -> None:
    result = multigpu("verify", "--strategy", "dp", SCRIPT)
    assert result.returncode == 2 and result.stdout.count("\n") == 1, result.stdout
    assert "--strategy dp splits each batch over the GPUs of one process" in result.stdout
    result = multigpu("verify", "--strategy", "dp", "--nproc", "2", SCRIPT)
    assert result.returncode == 2 and "drop --nproc" in result.stdout and result.stdout.count("\n") == 1


def test_a_usage_error_in_the_script_is_printed_once() -> None:
    """`single` in 2 processes: the Engine refuses on both ranks; verify prints the sentence once, exit 2."""
    result = multigpu("verify", "--strategy", "single", "--steps", "1", SCRIPT, timeout=120)
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines() == [
        "multigpu: error: Strategy single runs in one process, but 2 were launched and would each train alone; "
        "launch one process, or use ddp/zero1/zero2/zero3."
    ]


def test_refuses_one_process_compared_with_itself() -> None:
    result = multigpu("verify", "--nproc", "1", SCRIPT)
    assert result.returncode == 2 and "--nproc 1 compares one process with itself" in result.stdout


def test_one_process_under_a_strategy_against_the_plain_run() -> None:
    """What one GPU can check: the strategy's wrapping and precision path in a group of one."""
    code, report = verify("--nproc", "1", "--strategy", "zero3")
    assert code == 0 and report["passed"] and report["strategy"] == "zero3", report
