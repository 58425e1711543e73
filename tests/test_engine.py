"""Engine collectives and lone-process groups, in real processes."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

import multigpu as mg
from tests.dist import run_in_processes


def collectives(samples: int) -> dict:
    engine = mg.Engine(strategy="ddp")
    data = TensorDataset(torch.arange(samples), torch.arange(samples) * 10)
    per_batch, whole_epoch = [], []
    for _, value in engine.dataloader(data, batch_size=3, shuffle=False):
        per_batch.append(engine.gather(value))
        whole_epoch.append(value)
    gathered_epoch = engine.gather(torch.cat(whole_epoch))
    # gather maps rows onto the loader iterated last: now this shuffled one.
    shuffled = torch.cat([value for _, value in engine.dataloader(data, batch_size=2, shuffle=True)])
    return {
        "per_batch": torch.cat(per_batch),
        "whole_epoch": gathered_epoch,
        "shuffled_epoch": engine.gather(shuffled),
        "mean": engine.reduce(float(engine.rank)),
        "sum": engine.reduce(torch.tensor([engine.rank, 1.0]), op="sum"),
        "max": engine.reduce(engine.rank * 2.5, op="max"),
    }


def test_gather_and_reduce_over_three_ranks_with_an_uneven_dataset() -> None:
    samples = 20  # global batches of 9, 9 and 2: the last leaves one rank with padding only
    results = run_in_processes("tests.test_engine:collectives", 3, timeout=120, samples=samples)
    expected = torch.arange(samples) * 10
    for result in results:
        assert torch.equal(result["per_batch"], expected)
        assert torch.equal(result["whole_epoch"], expected)
        assert torch.equal(result["shuffled_epoch"], expected)  # dataset order, whatever the shuffle
        assert result["mean"] == 1.0
        assert torch.equal(result["sum"], torch.tensor([3.0, 3.0]))
        assert result["max"] == 5.0


def lone_ddp() -> tuple[str, int, float]:
    engine = mg.Engine(strategy="ddp")
    return engine.strategy, engine.world_size, engine.reduce(4.0)


def test_ddp_in_one_process_builds_a_group_of_one() -> None:
    assert run_in_processes("tests.test_engine:lone_ddp", 1, timeout=60) == [("ddp", 1, 4.0)]


def test_auto_is_single_in_one_process(capsys) -> None:
    engine = mg.Engine()
    assert engine.strategy == "single" and engine.world_size == 1 and engine.is_main_process
    assert "strategy auto -> single" in capsys.readouterr().out


def auto_two() -> tuple[str, str]:
    engine = mg.Engine()
    before = engine.strategy
    engine.setup(torch.nn.Linear(4, 4), None)
    return before, engine.strategy


def test_auto_with_two_processes_asks_the_planner_at_setup() -> None:
    assert run_in_processes("tests.test_engine:auto_two", 2, timeout=60) == [("auto", "ddp")] * 2
