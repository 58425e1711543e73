"""An optimizer step's accumulation window as the Engine counts it: which backward ends it, the weight each
micro-batch's loss backs up with (so that the step's gradient is the mean over its global batch), and what the step
added up to (its time outside backward, its samples, units and loss over all ranks) for the observers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from multigpu.core.errors import UsageError
from multigpu.data.loader import Batch
from multigpu.parallel.experts import MixtureOfExperts


@dataclass
class Totals:
    """What one optimizer step's micro-batches add up to."""

    busy_s: float = 0.0  # data loading and forward, i.e. the time outside backward and the optimizer step
    samples: int = 0  # real samples in the global batch (engine loader only)
    count: torch.Tensor | None = None  # this rank's units (tokens) when the loss is a sum; see Engine.backward
    loss: torch.Tensor | None = None  # this rank's share of the step's loss, when an observer wants it
    other_work: bool = False  # a checkpoint, evaluation or FLOP count ran inside this step's time


class Window:
    """The window under way: `grad_accum_steps` backwards, or the engine loader's batches that end it."""

    def __init__(
        self, grad_accum_steps: int, data_world: int, device: torch.device, wants_loss: bool, cp: int = 1
    ) -> None:
        # cp ranks read one batch but each computes the gradient of its own tokens: their gradients are averaged
        # with the data-parallel ranks', so a summed loss is weighted by all of them.
        self.grad_accum_steps, self.data_world, self.device, self.wants_loss = (
            grad_accum_steps,
            data_world * cp,
            device,
            wants_loss,
        )
        self.cp = cp
        self.backwards = 0  # backwards since the last optimizer step
        self.done = False  # the window's last backward has run: the next engine.step applies it
        self.batch: Batch | None = None  # the engine-loader batch being trained on, if any
        self.totals = Totals(other_work=True)  # the first step also pays for lazy initialisation
        self.mark = time.perf_counter()  # the time outside backward counts from here

    def syncs_next(self) -> bool:
        """Whether the next backward ends the window (and so must synchronise gradients): the engine loader's batch
        says so, or else it is the window's grad_accum_steps-th backward. Counting backwards, not engine.step calls,
        serves both loops: a step after every micro-step, or one after the window's backwards."""
        if self.batch is not None:
            return self.batch.ends_window
        return self.backwards + 1 >= self.grad_accum_steps

    def begin(self) -> bool:
        """Refuses a backward past the end of its window; returns whether this one ends it."""
        if self.done:
            raise UsageError(
                "engine.backward() was called after the last backward of its accumulation window (grad_accum_steps="
                f"{self.grad_accum_steps}, or the engine loader's last batches of an epoch); call "
                "engine.step(optimizer) once a window's backwards are done, before the next backward."
            )
        return self.syncs_next()

    def end_micro_step(self, ended: bool) -> None:
        self.backwards += 1
        self.done = ended
        self.mark = time.perf_counter()

    def account(
        self, loss: torch.Tensor, count: int | torch.Tensor | None, experts: MixtureOfExperts | None = None
    ) -> float:
        """Adds a micro-step's loss (and count) to the window; returns the weight its backward starts from, which
        `experts` (a mixture of experts, parallel/experts.py) gives its load-balancing loss too."""
        totals = self.totals
        totals.busy_s += time.perf_counter() - self.mark
        if self.batch is not None:
            totals.samples += self.batch.global_size
        summed = count is not None
        if not summed and self.cp > 1:
            raise UsageError(
                "Context parallelism gives each cp rank its own slice of every sequence's tokens, so the loss must be "
                "their sum: return (sum, count) from loss_fn (engine.lm_loss does), or pass count= to engine.backward."
            )
        if self.backwards > 0 and summed != (totals.count is not None):
            raise UsageError("Pass count= to engine.backward on every micro-step of an optimizer step, or on none.")
        weight = self.weight(summed)
        if summed:
            count = torch.as_tensor(count, dtype=torch.float64, device=self.device).detach()
            totals.count = count if totals.count is None else totals.count + count
        if self.wants_loss:  # three tensor ops a micro-step: only for an observer that reads the loss
            share = loss.double() if summed else loss.double() * weight / self.data_world
            totals.loss = share if totals.loss is None else totals.loss + share
        if experts is not None:
            experts.weigh(weight, count, self.data_world, self.device)
        return weight

    def weight(self, summed: bool) -> float:
        if summed:  # DDP and FSDP average gradients over the data-parallel ranks; this factor turns that into a sum
            return float(self.data_world)
        return self.batch.weight if self.batch is not None else 1.0 / self.grad_accum_steps

    def global_totals(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float | None, float | None]:
        """The step's units over all ranks (when the loss is a sum) and, for observers, its global loss;
        `all_reduce` sums a tensor over the ranks and divides by how many hold each replica's totals."""
        totals = self.totals
        if totals.count is None and totals.loss is None:
            return None, None
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        count, loss = all_reduce(torch.stack([zero if t is None else t for t in (totals.count, totals.loss)])).tolist()
        if totals.count is None:
            return None, loss
        return count, (loss / max(count, 1.0) if totals.loss is not None else None)

    def close(self) -> Totals:
        """Ends the window: returns what it added up to, and starts the next."""
        totals, self.totals = self.totals, Totals()
        self.backwards, self.done, self.batch = 0, False, None
        return totals


def accumulation_for(global_batch_size: int, batch_size: int, data_world: int) -> int:
    """The micro-batches per optimizer step that make `global_batch_size` samples from `batch_size` per device on
    `data_world` data-parallel ranks."""
    per_pass = batch_size * data_world
    steps, rest = divmod(global_batch_size, per_pass)
    if rest or not steps:
        raise UsageError(
            f"global_batch_size {global_batch_size} is not a multiple of batch_size {batch_size} x {data_world} "
            f"data-parallel process(es) = {per_pass}; choose a batch size and process count whose product divides it."
        )
    return steps
