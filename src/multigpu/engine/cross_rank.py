"""What the Engine does across its ranks for a training loop: reduce a value, gather rows in dataset order, wait
for every rank, print once."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from multigpu.core.env import DistEnv, all_reduce_value, collective_device, grouped
from multigpu.core.errors import UsageError
from multigpu.data.loader import gather_in_order
from multigpu.data.stream import StreamLoader
from multigpu.observers.observe import watching


class AcrossRanks:
    """A mixin of the Engine: who this rank is among all of them, and what it does with them. Reads the Engine's
    environment, observers, device, loader, layout and data ranks."""

    env: DistEnv
    _replicas: Any  # engine/replicas.py's Replicas under fault tolerance, else None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        """Rank 0; under fault tolerance, replica group 0's (which prints, logs and records the run)."""
        return self.env.rank == 0 and (self._replicas is None or self._replicas.group.group_id == 0)

    def reduce(self, value: float | torch.Tensor, op: str = "mean") -> float | torch.Tensor:
        """`value` combined over all ranks ("mean", "sum" or "max"), returned on every rank as the same type."""
        with watching(self.observers, "reduce"):
            return all_reduce_value(value, op, self.device)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows from every rank, padding removed, in dataset order.

        `tensor`'s rows must belong to the last `len(tensor)` samples this rank's engine loader yielded (a batch's
        outputs, or everything collected over the epoch; a streamed loader's last batch only: it keeps no epoch).
        """
        self.mark_untimed()  # evaluation, usually
        if isinstance(self._loader, StreamLoader) and len(tensor) > self._loader.batch_size:
            raise UsageError(
                f"engine.gather got {len(tensor)} rows, more than a batch of the streamed loader, which keeps only its "
                "last batch's sample order; gather each batch's outputs as it comes."
            )
        batches = self._loader.yielded if self._loader is not None else []
        with watching(self.observers, "gather"):
            return gather_in_order(tensor, batches, self.device)

    def barrier(self) -> None:
        if grouped():
            with watching(self.observers, "barrier"):
                dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def _sum_over_replicas(self, totals: torch.Tensor) -> torch.Tensor:
        """A step's `totals` summed over every rank, each replica's counted once: the tp and pp ranks of a replica
        hold the same totals, its cp ranks each their own tokens'."""
        if grouped():
            totals = totals.to(collective_device(self.device))
            with watching(self._hooks.watchers, "step totals"):  # the watching observers': this runs every step
                dist.all_reduce(totals)
            layout = self._strategy.layout
            totals = totals / (layout.tp * layout.pp)
        if self._replicas is not None:  # and over the replica groups of the step's quorum (fault tolerance)
            totals = self._replicas.sum(totals)
        return totals
