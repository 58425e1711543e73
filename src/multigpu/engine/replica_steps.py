"""The Engine's steps under fault tolerance (a base class of Engine): each training window split among the replica
groups of its quorum, each step committed by all of them or run again, and the state a healing group copies.
engine/replicas.py says why each is so; without fault tolerance none of this runs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from multigpu.core.errors import UsageError
from multigpu.data.loader import DistributedLoader
from multigpu.data.stream import Loader
from multigpu.engine.replicas import Replicas
from multigpu.engine.window import Window
from multigpu.observers.observe import StepObserver


class ReplicaSteps:
    """What fault tolerance reads of the Engine, and the calls it adds to it."""

    _replicas: Replicas | None = None
    _model: nn.Module | None
    _window: Window
    _steps: int
    skipped_steps: int
    observers: list[StepObserver]
    _group_rank: int  # this rank's data-parallel place inside its replica group
    _group_world: int  # and the group's data-parallel ranks
    _cp: Any
    _train_loader: Loader | None

    def heal_with(self, state: dict[str, Any]) -> None:
        """Under fault tolerance, `state` (what the script checkpoints: modules, optimizers, loaders, schedulers and
        plain values such as its step count) is what a replica group that rejoins copies from a live one, besides
        what the Engine knows (the set-up model, its optimizer, the engine loaders, the step counters); plain values
        are replaced in `state`. Outside fault tolerance it does nothing."""
        self._healed_state = state

    @property
    def replica_quorum(self) -> dict[str, int] | None:
        """Under fault tolerance: the replica groups in the last step's quorum, of how many, the steps run again
        so far, and the step this group healed at (if it did)."""
        replicas = self._replicas
        if replicas is None:
            return None
        record = {"replicas": replicas.quorum, "replica_groups": replicas.group.groups, "reruns": replicas.reruns}
        if replicas.healed_at is not None:
            record["healed_at"] = replicas.healed_at
        return record

    def _follow_replicas(self, loader: Loader, num_workers: int) -> None:
        """Has `loader` split each training window among the quorum's groups (fault tolerance only)."""
        if self._replicas is None:
            return
        if not isinstance(loader, DistributedLoader) or num_workers > 0:
            raise UsageError(
                "Fault tolerance splits each step's batch among the replica groups alive at that step, which needs "
                "a dataset with a length read in the main process; pass num_workers=0 and a map-style dataset."
            )
        self._ft_loaders.append(loader)
        loader.before_window = lambda: self._begin_window(loader)

    def _begin_window(self, loader: DistributedLoader) -> None:
        replicas, group, world = self._replicas, self._group_rank, self._group_world
        assert replicas is not None
        if self._model is not None and not self._model.training:  # an evaluation: each group reads all of it
            loader.set_split((group, world))
            return
        place, alive = replicas.begin_step()
        loader.set_split((place * world + group, alive * world))
        self._window.data_world = alive * world * self._window.cp

    def _follow_step(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None) -> None:
        """Knows the optimizer and scheduler a step is given, for healing; places a healed scheduler's state."""
        replicas = self._replicas
        if replicas is None:
            return
        if all(optimizer is not known for known in self._ft_optimizers):
            self._ft_optimizers.append(optimizer)
        if scheduler is not None and self._ft_scheduler is None:
            self._ft_scheduler = scheduler
            healed = replicas.unplaced.pop("engine/scheduler", None)
            if healed is not None:
                scheduler.load_state_dict(healed)

    def _commit_across_replicas(self, optimizer: torch.optim.Optimizer) -> bool:
        """Averages the step's gradients over the groups and asks them all to commit; a step that cannot is
        undone and its window handed out again."""
        replicas = self._replicas
        if replicas is None:
            return True
        assert self._model is not None
        replicas.average(self._model)
        if replicas.commit():
            return True
        optimizer.zero_grad(set_to_none=True)
        self._window.close()
        if isinstance(self._train_loader, DistributedLoader):  # the loader whose batches the window trained on
            self._train_loader.rewind_window()
        return False

    def _heal_state(self) -> dict[str, Any]:
        script = getattr(self, "_healed_state", {})
        known = {id(value) for value in script.values()}
        engine: dict[str, Any] = {"model": self._model, "counters": _Counters(self)}
        engine |= {f"optimizer/{i}": o for i, o in enumerate(self._ft_optimizers)}
        engine |= {f"loader/{i}": loader for i, loader in enumerate(self._ft_loaders)}
        if self._ft_scheduler is not None:
            engine["scheduler"] = self._ft_scheduler
        return {"script": script, "engine": {k: v for k, v in engine.items() if id(v) not in known and v is not None}}

    _ft_loaders: list[DistributedLoader]
    _ft_optimizers: list[torch.optim.Optimizer]
    _ft_scheduler: LRScheduler | None = None


class _Counters:
    """The Engine's step counters, as a healing group copies them (and its observers continue them)."""

    def __init__(self, engine: ReplicaSteps) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.engine._steps, "skipped_steps": self.engine.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.engine._steps, self.engine.skipped_steps = state["steps"], state["skipped_steps"]
        for observer in self.engine.observers:
            observer.on_resume(self.engine._steps)
