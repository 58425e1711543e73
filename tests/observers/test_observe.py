"""The observer seam: what a script's own StepObserver sees of a run, in real processes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from tests.dist import run_in_processes


class Notes(mg.StepObserver):
    """Writes down every hook call."""

    wants_loss = True

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.ops: set[str] = set()
        self.stats: list[mg.StepStats] = []
        self.logged: list[int] = []
        self.resumed: list[int] = []

    def configure(self, config: mg.EngineConfig) -> mg.EngineConfig:
        self.calls.append("configure")
        return replace(config, grad_accum_steps=2)  # the script asked for 1

    def attach(self, engine: mg.Engine) -> None:
        self.calls.append("attach")

    def on_setup(self, model: nn.Module) -> None:
        self.calls.append("on_setup")

    def watch(self, op: str):
        self.ops.add(op)
        return super().watch(op)

    def on_step_end(self, stats: mg.StepStats) -> None:
        self.stats.append(stats)

    def on_log(self, step: int, record: dict) -> None:
        self.logged.append(step)

    def on_resume(self, step: int) -> None:
        self.resumed.append(step)


def observed_run(directory: str) -> dict:
    notes = Notes()
    engine = mg.Engine(strategy="ddp", observers=[notes])
    model, optimizer = engine.setup(nn.Linear(3, 1), torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(48.0).reshape(16, 3) / 48, torch.arange(16.0).reshape(16, 1) / 16)
    micro_losses, window_losses = [], []
    for x, y in engine.dataloader(data, batch_size=2, shuffle=False):
        with engine.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
        micro_losses.append(loss.item())
        if engine.step(optimizer):
            window_losses.append(engine.reduce(sum(micro_losses) / len(micro_losses)))
            micro_losses = []
    engine.log(len(notes.stats), {"done": 1.0})
    path = Path(directory) / "step-4"
    engine.save(path, {"model": model})
    engine.load(path, {"model": model})
    return {
        "calls": notes.calls,
        "ops": sorted(notes.ops),
        "steps": [(s.step, s.samples, s.timed, s.applied) for s in notes.stats],
        "losses": [s.loss for s in notes.stats],
        "expected_losses": window_losses,
        "logged": notes.logged,
        "resumed": notes.resumed,
    }


def test_a_scripts_observer_sees_every_hook_and_overrides_settings(tmp_path: Path) -> None:
    ranks = run_in_processes("tests.observers.test_observe:observed_run", 2, timeout=120, directory=str(tmp_path))
    for rank, seen in enumerate(ranks):
        assert seen["calls"] == ["configure", "attach", "on_setup"]
        assert {"forward", "backward", "optimizer step", "step totals", "reduce", "save", "load"} <= set(seen["ops"])
        # 16 samples, 2 per device x 2 processes x 2 micro-steps (the observer's accumulation): 2 steps of 8.
        # The first step also pays for lazy initialisation, so it is not timed.
        assert seen["steps"] == [(1, 8, False, True), (2, 8, True, True)]
        # The global loss is the mean over both ranks' micro-batches, all equal in size here; both are sums of
        # the same few float32 values in float64, in different orders: equal to far below float32's resolution.
        assert seen["losses"] == pytest.approx(seen["expected_losses"], rel=1e-9)
        assert seen["logged"] == ([2] if rank == 0 else [])  # engine.log reaches observers on the main process
        assert seen["resumed"] == [2]  # the checkpoint carried the engine's count of steps


def test_an_unknown_engine_setting_is_one_sentence() -> None:
    with pytest.raises(mg.UsageError, match=r"Engine got unknown setting\(s\) grad_acum_steps; the settings are"):
        mg.Engine(strategy="single", grad_acum_steps=2)


def test_an_observer_that_breaks_the_settings_is_refused() -> None:
    class Shorter(mg.StepObserver):
        def configure(self, config: mg.EngineConfig) -> mg.EngineConfig:
            return replace(config, timeout_s=1.0)

    class Zero(mg.StepObserver):
        def configure(self, config: mg.EngineConfig) -> mg.EngineConfig:
            config.grad_accum_steps = 0  # changed in place, past the dataclass's checks
            return config

    engine = mg.Engine(strategy="single", observers=[Shorter()])
    assert engine.config.timeout_s == 1.0
    with pytest.raises(mg.UsageError, match="grad_accum_steps must be 1 or more"):
        mg.Engine(strategy="single", observers=[Zero()])
