"""What a resume may change of the run it continues (recipes/resume_changes.py), in one process: the rules name the
recipes' settings; the optimizer that wrote a checkpoint is the checkpoint's own word (the run's record where it has
none); another AdamW converts, while another optimizer's states or Muon's other split are refused in a sentence
naming the flag and the run's value; the optimizer keeps this run's hyperparameters and the schedule's lr, which
follows a changed --lr. (The recipes as launched: tests/recipes/test_finetune.py and test_train.py.)"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import multigpu as mg
from multigpu.engine.lr_schedule import SampleSchedule
from multigpu.recipes.finetune import FinetuneConfig
from multigpu.recipes.resume_changes import (
    DATA,
    FINETUNE,
    TRAIN,
    ResumeRules,
    check_resume,
    follow_new_lr,
    following_hyperparameters,
)
from multigpu.recipes.train import TrainConfig

RULES = ResumeRules(same={"data": DATA}, schedule=(), lr=("lr",))


@dataclass
class Resumed:
    """The settings check_resume reads of a recipe's config."""

    optimizer: str = "adamw"
    muon_params: str = "hidden"
    data: str = "a"
    lr: float = 1e-3


def saved(tmp_path: Path, optimizer: str | None, record: dict) -> Path:
    """A checkpoint in a run's save dir, written by an optimizer of kind `optimizer` (None: one of a script's own,
    which the checkpoint cannot name), and the run's config.yaml `record`."""
    model = nn.Linear(4, 4)
    engine = mg.Engine(strategy="single", optimizer=optimizer or "adamw")
    built = engine.optimizer(model, 1e-3) if optimizer else torch.optim.Adam(model.parameters())
    model, built = engine.setup(model, built)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(record))
    return engine.save(tmp_path / "checkpoints" / "step-1", {"model": model, "optimizer": built})


def test_the_rules_name_settings_the_recipes_have() -> None:
    for rules, config in ((FINETUNE, FinetuneConfig), (TRAIN, TrainConfig)):
        named = [*rules.same, *rules.schedule, *rules.lr]
        assert len(set(named)) == len(named) and set(named) <= {field.name for field in fields(config)}


def test_another_adamw_converts_and_other_states_are_refused_by_the_checkpoints_own_word(tmp_path: Path) -> None:
    # The record says adamw-8bit (a converted resume that crashed before its first checkpoint rewrote it): the
    # checkpoint's own kind decides.
    checkpoint = saved(tmp_path, "adamw", {"optimizer": "adamw-8bit", "data": "a"})
    assert check_resume(Resumed(optimizer="adamw-4bit"), checkpoint, RULES)["data"] == "a"
    with pytest.raises(mg.UsageError) as refused:
        check_resume(Resumed(optimizer="muon"), checkpoint, RULES)
    assert str(refused.value) == (
        f"--optimizer muon differs from adamw, which the run that wrote {checkpoint} trained with, and its "
        "checkpoint holds adamw's states, which muon does not take; pass --optimizer adamw (or another AdamW) to "
        "resume it, or start a new run with another --save-dir."
    )
    with pytest.raises(mg.UsageError, match=f"--data b differs from a, which the run that wrote {checkpoint} trained"):
        check_resume(Resumed(data="b"), checkpoint, RULES)


@pytest.mark.parametrize(
    ("value", "was", "said"),
    [
        (None, "a", "no --data differs from a, which the run that wrote"),
        ("b", None, "--data b differs from none, which the run that wrote"),
        (False, True, "--no-data differs from --data, which the run that wrote"),
    ],
)
def test_a_switch_or_a_setting_left_unset_is_named_as_typed(
    value: object, was: object, said: str, tmp_path: Path
) -> None:
    checkpoint = saved(tmp_path, "adamw", {"data": was})
    with pytest.raises(mg.UsageError) as refused:
        check_resume(Resumed(data=value), checkpoint, RULES)  # type: ignore[arg-type]
    remedy = "drop --data" if was is None else "pass --data" if was is True else f"pass --data {was}"
    assert str(refused.value).startswith(said) and f"; {remedy} to resume it, or start a new run" in str(refused.value)


def test_without_the_checkpoints_word_the_runs_record_names_its_optimizer(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path, None, {"optimizer": "muon", "muon_params": "hidden"})
    check_resume(Resumed(optimizer="muon"), checkpoint, RULES)
    with pytest.raises(mg.UsageError, match="--muon-params matrices differs from hidden, which the run that wrote"):
        check_resume(Resumed(optimizer="muon", muon_params="matrices"), checkpoint, RULES)
    with pytest.raises(mg.UsageError, match="holds muon's states, which adamw does not take; pass --optimizer muon "):
        check_resume(Resumed(optimizer="adamw"), checkpoint, RULES)


def test_the_optimizer_keeps_this_runs_hyperparameters_and_the_checkpoints_lr() -> None:
    run = torch.optim.AdamW(nn.Linear(4, 4).parameters(), lr=5e-4, weight_decay=0.0, betas=(0.8, 0.9))
    resumed = torch.optim.AdamW(nn.Linear(4, 4).parameters(), lr=1e-3, weight_decay=0.1)
    with following_hyperparameters(resumed):
        resumed.load_state_dict(run.state_dict())
    group = resumed.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (5e-4, 0.1, (0.9, 0.999))


class Position:
    """A loader's position, as SampleSchedule reads it."""

    samples_seen = 40

    def next_step_samples(self) -> int:
        return 10


def test_a_changed_lr_sets_the_schedules_peak_from_the_samples_done() -> None:
    optimizer = torch.optim.AdamW(nn.Linear(4, 4).parameters(), lr=1e-3)
    scheduler = SampleSchedule(optimizer, Position(), 0, 100)
    factor = optimizer.param_groups[0]["lr"] / 1e-3
    assert follow_new_lr(scheduler, Resumed(lr=1e-3), {"lr": 1e-3}, ("lr",), 1e-3) is None
    kept = follow_new_lr(scheduler, Resumed(lr=1e-3), {"lr": 1e-3}, ("lr",), 2e-3)  # lr scaling at another size
    assert kept == "the lr schedule keeps the run's planned lr 0.001 (not 0.002)"
    line = follow_new_lr(scheduler, Resumed(lr=4e-3), {"lr": 1e-3}, ("lr",), 4e-3)
    assert line == "the lr schedule follows --lr 0.004: peak lr 0.004 (planned: 0.001)"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(factor * 4e-3, rel=1e-12)
