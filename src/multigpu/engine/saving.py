"""The Engine's checkpoint calls (a base class of Engine): save, load and the state dicts, over checkpoint/.

They read what the Engine holds: its strategy, its observers (a save or load is watched and untimed), and its step
counters, which every checkpoint carries under COUNTERS so that reports and logs continue across a resume.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multigpu import checkpoint
from multigpu.observers.observe import StepObserver, watching
from multigpu.optimizers.convert import conversions, optimizer_kinds
from multigpu.strategies import Strategy

COUNTERS = "multigpu.engine"  # the engine's own entry in every checkpoint it writes
OPTIMIZER_KINDS = "multigpu.optimizers"  # and the kind of each optimizer there (optimizers/convert.py)


class Saving:
    """What the Engine's checkpoint calls read of it (and its mark_untimed, barrier and print, which they call)."""

    _strategy: Strategy
    observers: list[StepObserver]
    _steps: int
    skipped_steps: int
    _pending_save: tuple[Future, Path] | None = None  # a background save and where it goes
    _replicas: Any  # engine/replicas.py's Replicas under fault tolerance, else None

    def save(
        self, path: str | Path, state: dict[str, Any], async_save: bool = False, keep_last: int | None = None
    ) -> Path:
        """Writes `state` (modules, optimizers, anything with state_dict, plain values, RNG) as a sharded checkpoint.

        Every rank writes its own shards; nothing is gathered onto rank 0. The directory appears only once
        complete. With `async_save` the tensors are copied and written in the background: call
        `wait_for_checkpoint()` before exiting. `keep_last` removes all but the newest K `step-N` siblings.
        """
        self.wait_for_checkpoint()
        self.mark_untimed()
        if self._replicas is not None and self._replicas.place != 0:
            return Path(path)  # every replica group holds the same state: the first in the step's quorum writes it
        counters = {"steps": self._steps, "skipped_steps": self.skipped_steps}
        path, state = Path(path), {**state, COUNTERS: counters, OPTIMIZER_KINDS: optimizer_kinds(state)}
        with watching(self.observers, "save"):
            if async_save:
                self._pending_save = (checkpoint.save_async(path, state, self._strategy, keep_last), path)
            else:
                checkpoint.save(path, state, self._strategy, keep_last)
        return path

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """What this rank writes of `model` into a checkpoint: its trainable weights and buffers, keyed as in the
        unwrapped model (whole tensors, DTensor shards under FSDP2, or this rank's share of the whole tensors under
        DeepSpeed). Every rank must call it: assembling them is a collective."""
        return self._strategy.model_state_dict(model)

    def full_state_dict(self, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """`model`'s whole weights and buffers (frozen weights left out with `trainable_only`) on rank 0's CPU, an
        empty dict on the other ranks, keyed as in the unwrapped model: for writing a model or adapter out.
        Assembled one tensor at a time, so no device holds more than one whole tensor besides its own shard.
        Every rank must call it."""
        return self._strategy.full_state_dict(model, trainable_only)

    def wait_for_checkpoint(self) -> None:
        """Blocks until a background save has finished (and re-raises its error, if it failed)."""
        if self._pending_save is not None:
            (pending, path), self._pending_save = self._pending_save, None
            checkpoint.wait(pending, path)
            self.barrier()

    def load(self, path: str | Path, state: dict[str, Any]) -> None:
        """Restores `state` in place from a checkpoint written at any world size and with any strategy; an
        optimizer there of another kind of AdamW converts into the one in `state`, which says so (rank 0)."""
        self.wait_for_checkpoint()
        self.mark_untimed()
        restored = {**state, COUNTERS: None}
        converting = conversions(Path(path), state, checkpoint.saved_entry(path, OPTIMIZER_KINDS) or {})
        with watching(self.observers, "load"):
            lines = checkpoint.load(path, restored, self._strategy, optional=(COUNTERS,), conversions=converting)
        for line in lines:  # an optimizer that took another AdamW's states, and how exactly
            self.print(line)
        state.update({key: restored[key] for key in state})  # plain values are replaced, not loaded in place
        if restored[COUNTERS] is not None:  # the counts carry on, for reports, logs and stuck-rank messages
            self._steps, self.skipped_steps = (int(restored[COUNTERS][key]) for key in ("steps", "skipped_steps"))
            for observer in self.observers:
                observer.on_resume(self._steps)
