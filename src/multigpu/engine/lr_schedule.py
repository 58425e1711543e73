"""A learning-rate schedule over the samples trained on, so a resume at another world size continues it exactly.

A schedule over optimizer steps breaks when the number of processes changes on resume: a step then covers another
number of samples, so the same step count lands elsewhere in the data. Resumed at 3 processes, a run planned for 2
reached its last step a third of the way early and spent the rest at lr 0; resumed at 1 it ended the data with the
lr still high. Here the lr is a function of the position in the data (the engine loader's samples_seen, which
its checkpointed state gives), so every update sees the lr the uninterrupted run sees at that sample.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from multigpu.data.stream import Loader


def warmup_cosine(position: float, warmup: float, total: float) -> float:
    """The lr factor at `position`: linear from 0 over `warmup`, then half a cosine down to 0 at `total` (any unit:
    samples here; optimizer steps where a fixed batch makes them equivalent)."""
    if position < warmup:
        return position / warmup
    progress = (position - warmup) / max(total - warmup, 1e-12)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class SampleSchedule(LRScheduler):
    """Warm-up then cosine decay over the samples trained on (all ranks together).

    `warmup_samples` and `total_samples` are fixed when the run starts and kept in the checkpoint, so a resume at
    another world size keeps the schedule the run was planned with. The lr of each update is the factor at the
    number of samples trained on once it is done (those of the updates before it, plus its own), so the first
    update does not run at lr 0. The samples of an update that fp16 loss scaling skipped do not count (the Engine
    reports them through `skip`): the schedule waits, as a step schedule does, so the updates that happen keep
    the lrs planned for them.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loader: Loader,
        warmup_samples: int,
        total_samples: int,
    ) -> None:
        self.loader, self.warmup_samples, self.total_samples = loader, warmup_samples, total_samples
        self.skipped_samples = 0
        super().__init__(optimizer)

    @property
    def seen(self) -> int:
        """Samples the loader has handed out so far, over every epoch and every rank."""
        return self.loader.samples_seen

    @property
    def samples(self) -> int:
        """Samples the updates applied so far trained on: what the lr follows."""
        return self.seen - self.skipped_samples

    @property
    def done(self) -> bool:
        """Whether the data planned for the run has all been handed out."""
        return self.seen >= self.total_samples

    def skip(self, samples: int) -> None:
        """An update over `samples` samples was skipped (fp16 overflow): the lr stays where it was."""
        self.skipped_samples += samples

    def get_lr(self) -> list[float]:
        return self._lrs()

    def _lrs(self) -> list[float]:
        """The lrs of the next update."""
        end = self.samples + self.loader.next_step_samples()
        factor = warmup_cosine(end, self.warmup_samples, self.total_samples)
        return [base * factor for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {
            "warmup_samples": self.warmup_samples,
            "total_samples": self.total_samples,
            "skipped_samples": self.skipped_samples,
            "base_lrs": self.base_lrs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes the saved plan; the lr follows from the loader's position (load the loader first)."""
        self.skipped_samples = int(state["skipped_samples"])
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
        self.replan(int(state["warmup_samples"]), int(state["total_samples"]))

    def replan(self, warmup_samples: int, total_samples: int) -> None:
        """Another plan from here on (a resumed run told to train longer or shorter): the lr of the next update
        follows the new warm-up and total at the samples already seen."""
        self.warmup_samples, self.total_samples = warmup_samples, total_samples
        for group, lr in zip(self.optimizer.param_groups, self._lrs(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
