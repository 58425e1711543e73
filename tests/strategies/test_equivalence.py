"""N processes must compute what one process computes: every strategy x precision x accumulation."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.dist import run_each_in_processes
from tests.reference import Case, Outcome, initial_loss, train_engine, train_reference

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MATRIX = [
    Case(strategy, precision, accum)
    for strategy, precision, accum in itertools.product(STRATEGIES, ("32", "bf16-mixed"), (1, 4))
] + [Case(strategy, precision, 2) for strategy, precision in itertools.product(STRATEGIES, ("fp16-mixed", "bf16-true"))]
# The same cases with forward and engine.backward as two calls (the loop above uses engine.forward_backward).
TWO_CALLS = {
    index: dataclasses.replace(MATRIX[index], two_calls=True)
    for index, case in enumerate(MATRIX)
    if case.precision in ("32", "fp16-mixed") and case.grad_accum_steps > 1
}


def assert_matches(case: Case, got: Outcome, want: Outcome) -> None:
    if case.precision == "32":
        for name, param in want.params.items():
            diff = (got.params[name] - param).abs().max().item()
            assert diff <= 1e-5, f"{case}: {name} differs from one process by {diff:.2e}"
        assert got.grad_norms == pytest.approx(want.grad_norms, rel=1e-5), f"{case}: clipping norms differ"
        assert max(want.grad_norms) > case.max_grad_norm, "the test must exercise clipping"
    else:
        # Low-precision rounding differs with the split; the trained model must still land where one process does.
        tolerance = 2e-2 if case.precision == "bf16-mixed" else 5e-2
        assert abs(got.loss - want.loss) <= tolerance, f"{case}: loss {got.loss:.4f} vs one process {want.loss:.4f}"
        # ...and training must move the loss by more than that tolerance, or a run that never stepped would pass
        # (measured: 1.415 -> 1.29, 0.12, in every low-precision cell).
        initial = initial_loss(case)
        for run, loss in (("one process", want.loss), ("the strategy", got.loss)):
            assert initial - loss > tolerance, (
                f"{case}: {run} moved the loss from {initial:.4f} to {loss:.4f}, not by more than {tolerance}"
            )


@pytest.fixture(scope="module")
def two_process_outcomes() -> list[list[Outcome]]:
    cases = MATRIX + list(TWO_CALLS.values())
    return run_each_in_processes("tests.reference:train_engine", 2, [{"case": case} for case in cases], timeout=300)


@pytest.mark.parametrize(
    "index", range(len(MATRIX)), ids=[f"{c.strategy}-{c.precision}-accum{c.grad_accum_steps}" for c in MATRIX]
)
def test_two_processes_match_one(two_process_outcomes: list[list[Outcome]], index: int) -> None:
    case = MATRIX[index]
    rank0, rank1 = (outcomes[index] for outcomes in two_process_outcomes)
    for name in rank0.params:  # every rank ends with the same model
        assert torch.equal(rank0.params[name], rank1.params[name])
    assert_matches(case, rank0, train_reference(case, world_size=2))


@pytest.mark.parametrize("index", TWO_CALLS, ids=[f"{MATRIX[i].strategy}-{MATRIX[i].precision}" for i in TWO_CALLS])
def test_forward_backward_is_the_two_calls_it_replaces(two_process_outcomes: list[list[Outcome]], index: int) -> None:
    """engine.forward_backward runs the very operations of `with accumulate: backward(loss_fn(model(x), y))`, in
    the same order: the weights agree bitwise, over accumulation windows, clipping and fp16 loss scaling."""
    one_call, two_calls = (
        two_process_outcomes[0][index],
        two_process_outcomes[0][len(MATRIX) + list(TWO_CALLS).index(index)],
    )
    assert one_call.params.keys() == two_calls.params.keys()
    for name, param in one_call.params.items():
        assert torch.equal(param, two_calls.params[name]), name
    assert one_call.grad_norms == two_calls.grad_norms


THREE_PROCESS = [
    Case("ddp", samples=20),
    Case("zero3", samples=20, grad_accum_steps=2),
    Case("zero1", samples=20),
]


def test_three_processes_uneven_dataset() -> None:
    """20 samples over 3 ranks: the last global batch has 2 samples, so one rank holds only padding."""
    outcomes = run_each_in_processes(
        "tests.reference:train_engine", 3, [{"case": case} for case in THREE_PROCESS], timeout=180
    )
    for index, case in enumerate(THREE_PROCESS):
        assert_matches(case, outcomes[0][index], train_reference(case, world_size=3))


@pytest.mark.parametrize("strategy", ["single", "dp"])
@pytest.mark.parametrize("accum", [1, 3])
def test_one_process_strategies_match_reference(strategy: str, accum: int) -> None:
    case = Case(strategy, grad_accum_steps=accum)
    assert_matches(case, train_engine(case), train_reference(case, world_size=1))


def test_a_low_precision_comparison_fails_runs_that_did_not_train() -> None:
    """Two runs that never stepped (lr 0: both at the initial loss) agree within any tolerance; the comparison must
    still fail them."""
    case = Case("ddp", "bf16-mixed", 2, lr=0.0)
    still = train_reference(case, world_size=2)
    assert still.loss == pytest.approx(initial_loss(case), abs=1e-3)  # lr 0: nothing moved
    with pytest.raises(AssertionError, match=r"one process moved the loss from 1\.41"):
        assert_matches(case, still, still)
