"""What a resumed run may change of the run that wrote its checkpoint, recipe by recipe (docs/guide.md, "Changing
settings on resume"). Each change either continues the run or is refused before any worker starts, in one sentence
naming its flag, the value the run was started with, and how to start anew:

- refused (ResumeRules.same): the data and its order (the checkpoint's loader position counts samples of that data
  in that order), and what makes the weights (the checkpoint holds that model's parameters);
- the optimizer: another AdamW takes the states over (optimizers/convert.py, a line says how exactly); an optimizer
  with other states is refused, and so is another split of the weights between Muon and AdamW (muon_params);
- followed from the samples done: the lr schedule's length (ResumeRules.schedule) and its peak lr (ResumeRules.lr);
- followed from the next step: the optimizer's hyperparameters (weight decay, betas, momentum, Newton-Schulz steps);
- everything else continues as a resume at another world size does: world size, strategy and layout, batch size,
  shares and accumulation, precision, the pipeline's schedule, compilation, checkpointing and logging.

The run's settings come from its record (run_record), read before its checkpoint loads, since rank 0 rewrites it
for the resumed run once that has; the optimizer's kind from the checkpoint itself, where it names it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from multigpu import checkpoint
from multigpu.core.errors import UsageError
from multigpu.engine.lr_schedule import SampleSchedule
from multigpu.engine.saving import OPTIMIZER_KINDS
from multigpu.optimizers.convert import ADAMW_KINDS
from multigpu.recipes.common import run_record

# Why a setting stays as the run had it: the end of the clause that refuses its change.
DATA = "trained on, and a resume continues that run's data"
ORDER = "drew its data order from, and a resume continues that order"
WEIGHTS = "trained with, and its checkpoint holds that run's weights"


@dataclass(frozen=True)
class ResumeRules:
    """A recipe's settings that a resume may not change (each with why), and those of its lr schedule that it
    follows; the optimizer's are the same for every recipe, and any other setting continues as it is."""

    same: dict[str, str]
    schedule: tuple[str, ...]  # the schedule's length: planned anew from the samples done (follow_new_plan)
    lr: tuple[str, ...]  # what sets the schedule's peak lr (follow_new_lr)


FINETUNE = ResumeRules(
    same={
        **dict.fromkeys(("data", "data_split", "data_format", "data_column", "data_streaming", "seq_len"), DATA),
        **dict.fromkeys(("packing", "learn_turns", "too_long", "eval_data", "val_fraction"), DATA),
        "seed": ORDER,
        **dict.fromkeys(("model", "method", "lora_r", "lora_alpha", "lora_experts"), WEIGHTS),
    },
    schedule=("max_steps", "epochs", "warmup_steps"),
    lr=("lr",),
)
TRAIN = ResumeRules(
    same={"data": DATA, "seed": ORDER, "mode": WEIGHTS},
    schedule=("epochs", "warmup_epochs"),
    lr=("lr", "lr_scaling"),
)


def check_resume(config: Any, resumed_from: Path | None, rules: ResumeRules) -> dict[str, Any]:
    """Refuses to resume `resumed_from` with a change `rules` or the optimizer do not allow, in one sentence;
    returns the run's record, for follow_changes (empty without a checkpoint or a record)."""
    if resumed_from is None:
        return {}
    record = run_record(resumed_from)
    for name, why in rules.same.items():
        if name in record and record[name] != getattr(config, name):
            raise _changed(name, getattr(config, name), record[name], f"which the run that wrote {resumed_from} {why}")
    _check_optimizer(config, resumed_from, record)
    return record


def _check_optimizer(config: Any, resumed_from: Path, record: dict[str, Any]) -> None:
    """Another AdamW converts the checkpoint's states; an optimizer with other states, or Muon over other weights,
    is refused."""
    saved = (checkpoint.saved_entry(resumed_from, OPTIMIZER_KINDS) or {}).get("optimizer") or record.get("optimizer")
    wrote = f"which the run that wrote {resumed_from} trained with"
    if saved not in (None, config.optimizer) and not (saved in ADAMW_KINDS and config.optimizer in ADAMW_KINDS):
        others = " (or another AdamW)" if saved in ADAMW_KINDS else ""
        why = f"{wrote}, and its checkpoint holds {saved}'s states, which {config.optimizer} does not take"
        raise _changed("optimizer", config.optimizer, saved, why, others)
    was = record.get("muon_params", config.muon_params)
    if saved == config.optimizer == "muon" and was != config.muon_params:
        why = f"{wrote}, and its checkpoint holds Muon's states for the weights that names and AdamW's for the rest"
        raise _changed("muon_params", config.muon_params, was, why)


def _changed(name: str, value: Any, was: Any, why: str, others: str = "") -> UsageError:
    """The sentence that refuses setting `name`'s change from `was` to `value` on resume."""
    flag = "--" + name.replace("_", "-")
    restore = f"drop {flag}" if was is None else f"pass {_as_flag(flag, was)}"
    return UsageError(
        f"{_as_flag(flag, value)} differs from {_shown(flag, was)}, {why}; {restore}{others} to resume it, or start a "
        "new run with another --save-dir."
    )


def _as_flag(flag: str, value: Any) -> str:
    """`flag` giving `value` as typed: `--packing` or `--no-packing` for a switch, `no --eval-data` for none."""
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"no {flag}" if value is None else f"{flag} {value}"


def _shown(flag: str, value: Any) -> str:
    """A run's `value` of `flag` in a sentence: a switch as typed, none as such."""
    return _as_flag(flag, value) if isinstance(value, bool) else "none" if value is None else str(value)


@contextlib.contextmanager
def following_hyperparameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around the checkpoint's load: the optimizer keeps the hyperparameters it was built with (this run's flags:
    weight decay, betas, momentum, ...) where the checkpoint's param groups would put back the run's; the lr
    stays the schedule's (follow_changes)."""
    built = [{key: value for key, value in group.items() if key not in _SCHEDULED} for group in optimizer.param_groups]
    yield
    for group, own in zip(optimizer.param_groups, built, strict=True):
        group.update(own)


_SCHEDULED = ("params", "lr", "initial_lr")  # a param group's entries that are not the flags' hyperparameters


def follow_changes(
    scheduler: SampleSchedule, config: Any, record: dict[str, Any], rules: ResumeRules, plan: tuple[int, int],
    lr: float,
) -> list[str]:  # fmt: skip
    """Honours the lr schedule's settings (`rules`' schedule and lr) that differ from the run's `record`
    (check_resume's): `plan` (warm-up and total samples) and the peak `lr`, as a new run would plan them, from the
    samples already seen. Unchanged settings keep the checkpoint's plan, so a resume at another world size stays
    exact. Returns the lines that say so."""
    planned = follow_new_plan(scheduler, config, record, rules.schedule, plan)
    peak = follow_new_lr(scheduler, config, record, rules.lr, lr)
    return [line for line in (planned, peak) if line is not None]


def follow_new_plan(
    scheduler: SampleSchedule, config: Any, record: dict[str, Any], names: tuple[str, ...], plan: tuple[int, int]
) -> str | None:
    """The schedule follows `plan` where settings of its length (`names`: --max-steps, --epochs, warm-up) differ
    from the run's `record`; the line that says so, or None."""
    changed = changed_flags(config, record, names)
    if not changed:
        return None
    before = scheduler.total_samples
    scheduler.replan(*plan)
    return f"the lr schedule follows {changed}: {plan[1]} samples in all (planned: {before}), {scheduler.seen} done"


def follow_new_lr(
    scheduler: SampleSchedule, config: Any, record: dict[str, Any], names: tuple[str, ...], lr: float
) -> str | None:
    """The schedule's peak lr becomes `lr` where what sets it (`names`: --lr, train's --lr-scaling) differs from
    the run's `record`; unchanged, it keeps the run's (which lr scaling at another world size would change).
    The line that says which, where the two differ."""
    planned, changed = scheduler.base_lrs[0], changed_flags(config, record, names)
    if not changed:
        return None if planned == lr else f"the lr schedule keeps the run's planned lr {planned:g} (not {lr:g})"
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    scheduler.replan(scheduler.warmup_samples, scheduler.total_samples)
    return f"the lr schedule follows {changed}: peak lr {lr:g} (planned: {planned:g})"


def changed_flags(config: Any, record: dict[str, Any], names: tuple[str, ...]) -> str:
    """`names` whose setting differs from the run's `record`, as flags with their values ('' where none does)."""
    changed = [name for name in names if name in record and record[name] != getattr(config, name)]
    return ", ".join(f"--{name.replace('_', '-')} {getattr(config, name)}" for name in changed)
