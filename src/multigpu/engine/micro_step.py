"""One micro-step of the Engine (a base class of Engine): the forward and backward a training loop runs inside an
accumulation window (engine/window.py weighs each loss), skipping gradient communication until the window's last;
under pp one call through the pipeline schedule; and evaluation's forward only.

They read what the Engine holds: its strategy and precision plan, the set-up model and its mixture of experts, the
window, the observers' hooks, context parallelism and batch_shares auto's balancer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from multigpu.config.precision import PrecisionPlan
from multigpu.data.stream import Loader
from multigpu.engine.balance import Balancer
from multigpu.engine.window import Window
from multigpu.observers.observe import Hooks, watching
from multigpu.parallel.context import ContextParallel, sliced
from multigpu.parallel.experts import MixtureOfExperts
from multigpu.strategies import Strategy
from multigpu.transforms.loss import outputs_for
from multigpu.transforms.modules import call_with


class MicroSteps:
    """What the Engine's micro-step calls read of it, and the calls themselves."""

    _strategy: Strategy
    _plan: PrecisionPlan
    _model: nn.Module | None
    _experts: MixtureOfExperts | None
    _window: Window
    _hooks: Hooks
    _cp: ContextParallel | None
    _scaler: torch.amp.GradScaler | None
    _balance: Balancer | None
    _loader: Loader | None
    _train_loader: Loader | None
    _backward_ran: bool
    device: torch.device

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skips gradient communication on every micro-step but the last of an accumulation window, where the
        strategy accumulates that way (zero2/zero3 reduce-scatter every micro-step unless unsharded_grad_accum)."""
        if self._window.syncs_next() or not self._strategy.accumulates_unsynced:
            return contextlib.nullcontext()
        return self._strategy.no_sync(model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Inside it, backward keeps gradients local to each rank (bench's measure of the communication share)."""
        return self._strategy.no_sync(model)

    def backward(self, loss: torch.Tensor, count: int | torch.Tensor | None = None) -> None:
        """Backward of `loss` so that each optimizer step's gradient is the mean over its whole global batch.

        Without `count`, `loss` is the mean over this rank's batch; it is weighted by the batch's share of the
        step's samples (exact for uneven last batches and padding with the engine's loader; without it, divided
        by grad_accum_steps). With `count`, `loss` is a *sum* over `count` units (e.g. the tokens that are not
        padding): the step's gradient is then divided by the units of all ranks and micro-batches together,
        the token-normalised loss one process would compute over the same global batch.
        """
        syncs = self._window.begin()
        weight = self._account(loss.detach(), count, self._experts)
        if weight != 1.0:  # x * 1.0 is x, bit for bit, and so is its gradient: no node in the graph for it
            loss = loss * weight
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        self._hooks.backward_start()
        with watching(self._hooks.watchers, "backward"):
            self._strategy.backward(self._model, loss, syncs)
        self._hooks.backward_end()
        self._end_micro_step(syncs)

    def _account(
        self, loss: torch.Tensor, count: int | torch.Tensor | None, experts: MixtureOfExperts | None = None
    ) -> float:
        if self._window.batch is not None:
            self._train_loader = self._loader
        return self._window.account(loss, count, experts)

    def _end_micro_step(self, ended_window: bool) -> None:
        if self._balance is not None and self._window.batch is not None:
            self._balance.end_backward(self._window.batch.real)
        self._window.end_micro_step(ended_window)
        self._backward_ran = True

    def forward_backward(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]],
    ) -> torch.Tensor:
        """One micro-step in one call: `model(inputs)` (a dict is passed as keywords, a tuple as arguments), then
        `loss_fn(output, targets)`, then backward inside the accumulation window; returns the loss, detached.

        `loss_fn` returns the mean loss over the batch, or (sum, count) for a loss normalised by the count over the
        whole global batch (tokens), as engine.backward's `count`. The same call serves every strategy; under pp
        it is one step of the pipeline schedule over the batch's micro-batches, `output` is the last stage's (a
        Hugging Face model's logits) and the loss comes back on every rank.
        """
        inputs, targets, ring = sliced(self._cp, inputs, targets)
        if self._strategy.pipelined:
            with outputs_for(loss_fn), ring:
                return self._pipeline_micro_step(inputs, targets, loss_fn)
        with self.accumulate(model), outputs_for(loss_fn), ring:
            result = loss_fn(call_with(model, inputs), targets)
            loss, count = result if isinstance(result, tuple) else (result, None)
            self.backward(loss, count=count)
        return loss.detach()

    def _pipeline_micro_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Any]) -> torch.Tensor:
        def weigh(result: Any, share: float) -> torch.Tensor:
            # Each micro-batch's backward: a sum weighted as engine.backward weighs it, a mean by its share of rows.
            summed = isinstance(result, tuple)
            return result[0] * self._window.weight(True) if summed else result * self._window.weight(False) * share

        syncs = self._window.begin()
        experts, window = self._experts, self._window
        if experts is not None:  # weighed before the schedule runs: its backwards interleave with later forwards
            count_of = getattr(loss_fn, "count", None)  # engine.lm_loss's: the step's tokens, from the targets
            tokens = None if count_of is None else count_of(targets)
            experts.weigh_pipeline(window.weight(count_of is not None), tokens, window.data_world, window.device)
        self._hooks.backward_start()
        with watching(self._hooks.watchers, "pipeline step"), self._plan.autocast_context(self.device):
            loss, count = self._strategy.pipeline_step(inputs, targets, loss_fn, weigh, train=True, experts=experts)
        self._hooks.backward_end()
        self._account(loss, count)
        self._end_micro_step(syncs)
        return loss.float()

    def forward_loss(
        self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Any]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`loss_fn(model(inputs), targets)` without gradients, for evaluation, on every rank: under pp the
        schedule runs forward only and the last stage's loss is shared. Returns what loss_fn returns, detached."""
        inputs, targets, ring = sliced(self._cp, inputs, targets)
        with torch.no_grad(), outputs_for(loss_fn), ring:
            if self._strategy.pipelined:
                with self._plan.autocast_context(self.device):
                    loss, count = self._strategy.pipeline_step(inputs, targets, loss_fn, lambda r, s: r, train=False)
                return loss if count is None else (loss, count)
            result = loss_fn(call_with(model, inputs), targets)
        if isinstance(result, tuple):
            return tuple(r.detach() if torch.is_tensor(r) else r for r in result)
        return result.detach()
