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


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "deepspeed", "tp", "pp"])
def test_passes_a_correct_script(strategy: str) -> None:
    """Under tp and pp the two processes share each batch: the reference accumulates 1 batch per step, not 2."""
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


def test_refuses_one_process_compared_with_itself() -> None:
    result = multigpu("verify", "--nproc", "1", SCRIPT)
    assert result.returncode == 2 and "--nproc 1 compares one process with itself" in result.stdout


def test_one_process_under_a_strategy_against_the_plain_run() -> None:
    """What one GPU can check: the strategy's wrapping and precision path in a group of one."""
    code, report = verify("--nproc", "1", "--strategy", "zero3")
    assert code == 0 and report["passed"] and report["strategy"] == "zero3", report
