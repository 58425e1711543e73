"""Checkpoints through the Engine and the package's face: resume at another world size and strategy with exact data
order, a round trip that restores everything, another model's checkpoint named, and export reading the sharded
checkpoint the resume tests share (the other files here test one module each, on single_engine_state's state)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu import checkpoint
from tests.dist import run_in_processes
from tests.reference import Case, Outcome, TinyNet, train_reference

SAMPLES, GLOBAL_BATCH, STOP = 40, 6, 4  # 7 steps per epoch (the last one short): stop in the middle of epoch 0


def run(case: Case, nproc: int, **kwargs) -> Outcome:
    return run_in_processes("tests.reference:train_engine", nproc, timeout=120, case=case, **kwargs)


def samples_per_epoch(*runs: list[Outcome]) -> dict[int, Counter]:
    counts: dict[int, Counter] = {}
    for outcomes in runs:
        for outcome in outcomes:
            for epoch, indices in outcome.seen:
                counts.setdefault(epoch, Counter()).update(indices)
    return counts


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Outcome]]:
    """2 processes under zero3 (async save) train 4 steps of epoch 0, save and stop."""
    path = tmp_path_factory.mktemp("ckpt") / "step-4"
    case = Case("zero3", samples=SAMPLES, batch_size=GLOBAL_BATCH // 2, async_save=True)
    return path, run(case, 2, save_to=str(path), stop_after=STOP)


@pytest.mark.parametrize(("strategy", "nproc"), [("ddp", 1), ("zero1", 3), ("zero2", 2)])
def test_resume_at_another_world_size_and_strategy(saved, strategy: str, nproc: int) -> None:
    path, first = saved
    case = Case(strategy, samples=SAMPLES, batch_size=GLOBAL_BATCH // nproc)
    assert_resumed_exactly(first, run(case, nproc, resume_from=str(path)))


def assert_resumed_exactly(first: list[Outcome], second: list[Outcome]) -> None:
    # Every sample of every epoch exactly once, across the interruption and the change of world size.
    for epoch, counts in samples_per_epoch(first, second).items():
        assert counts == Counter(range(SAMPLES)), f"epoch {epoch}: {counts}"
    # ...and the same model as one uninterrupted process on the same global batches.
    want = train_reference(Case(samples=SAMPLES, batch_size=GLOBAL_BATCH), world_size=1)
    assert first[0].grad_norms + second[0].grad_norms == pytest.approx(want.grad_norms, rel=1e-5)
    for name, param in want.params.items():
        assert (second[0].params[name] - param).abs().max().item() <= 1e-5, name


def single_engine_state(tmp_path: Path, hidden: int = 16) -> tuple[mg.Engine, dict]:
    engine = mg.Engine(strategy="single")
    model = nn.Linear(4, hidden)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = engine.setup(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return engine, {"model": model, "optimizer": optimizer, "step": 3}


def test_single_process_round_trip_restores_everything(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path)
    engine.save(tmp_path / "step-3", state)
    random_before = torch.rand(3)
    torch.manual_seed(123)
    _, fresh = single_engine_state(tmp_path)
    fresh["step"] = 0
    engine.load(tmp_path / "step-3", fresh)
    assert fresh["step"] == 3
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    assert torch.equal(
        fresh["optimizer"].state_dict()["state"][0]["exp_avg"], state["optimizer"].state_dict()["state"][0]["exp_avg"]
    )
    assert torch.equal(torch.rand(3), random_before)  # the RNG continues where the save left it


def test_loading_another_models_checkpoint_names_the_mismatch(tmp_path: Path) -> None:
    engine, state = single_engine_state(tmp_path, hidden=16)
    engine.save(tmp_path / "step-1", state)
    _, other = single_engine_state(tmp_path, hidden=8)
    with pytest.raises(mg.UsageError, match=r"model.weight is \[16, 4\] there and \[8, 4\] here"):
        engine.load(tmp_path / "step-1", other)


def test_export_consolidates_a_sharded_checkpoint(saved) -> None:
    path, first = saved
    params = checkpoint.full_model_state(path)
    assert set(params) == set(first[0].params)
    for name, tensor in params.items():
        assert torch.equal(tensor, first[0].params[name])
    TinyNet().load_state_dict(params)  # loads into the plain model
