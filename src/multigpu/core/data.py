"""A distributed loader whose global batches do not depend on the number of processes.

Every epoch is one permutation of the dataset, the same on every rank and for every world size (it depends on
seed and epoch only). Global batches are consecutive slices of it; each rank takes every W-th sample of a slice.
So N processes see exactly the samples one process sees, batch for batch, and a run resumed at another world
size carries on from the same position in the same permutation: nothing repeated, nothing skipped.

The last global batch of an epoch may be short. It is split as evenly as possible; when it has fewer samples
than there are ranks, the ranks left over get one *padding* sample whose loss weight is zero (every rank must
run the same number of steps, or the collectives hang). `Batch.weight` makes the gradient of each optimizer step
the mean over the real samples of its global batch, whatever the split.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from multigpu.core.env import all_gather_rows, grouped
from multigpu.core.errors import UsageError


@dataclass(frozen=True)
class Batch:
    """Where a rank's batch sits in the epoch, and how much its mean loss counts."""

    indices: list[int]  # dataset indices this rank loads (padding included)
    real: int  # how many of them are real samples; the rest are padding
    global_size: int  # real samples across all ranks in this global batch
    weight: float  # multiplies the rank's mean loss so DDP's average becomes the window's sample mean
    ends_window: bool  # the last micro-batch of an optimizer step


def plan_epoch(
    num_samples: int,
    start: int,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    grad_accum_steps: int,
    drop_last: bool,
    order: list[int],
) -> list[Batch]:
    """This rank's batches from sample position `start` of the epoch to its end."""
    global_batch = batch_size * world_size
    stop = num_samples - (num_samples - start) % global_batch if drop_last else num_samples
    slices = [order[pos : min(pos + global_batch, stop)] for pos in range(start, stop, global_batch)]
    plan = []
    for first in range(0, len(slices), grad_accum_steps):
        window = slices[first : first + grad_accum_steps]
        window_samples = sum(len(s) for s in window)
        for i, chunk in enumerate(window):
            if len(chunk) >= world_size:
                indices, real = chunk[rank::world_size], len(chunk[rank::world_size])
            elif rank < len(chunk):
                indices, real = [chunk[rank]], 1
            else:
                indices, real = [chunk[0]], 0
            plan.append(
                Batch(
                    indices=indices,
                    real=real,
                    global_size=len(chunk),
                    weight=real * world_size / window_samples,
                    ends_window=i == len(window) - 1,
                )
            )
    return plan


def batch_size_line(batch: int, accum: int, world: int) -> str:
    """The global batch a loader makes, spelled out."""
    return (
        f"effective batch size {batch * accum * world} = {batch} per device x "
        f"{accum} accumulation step{'s' if accum > 1 else ''} x {world} process{'es' if world > 1 else ''}"
    )


def gather_in_order(tensor: torch.Tensor, batches: list[Batch], device: torch.device) -> torch.Tensor:
    """Every rank's rows of `tensor`, padding removed, in dataset order: `tensor`'s rows belong to the last
    `len(tensor)` samples in `batches`, what this rank's loader yielded this epoch."""
    owned = [(index, i < batch.real) for batch in batches for i, index in enumerate(batch.indices)]
    if len(tensor) > len(owned):
        raise UsageError(
            f"gather got {len(tensor)} rows but this rank's loader has yielded {len(owned)} samples this "
            "epoch; gather the outputs of samples from engine.dataloader."
        )
    owned = owned[len(owned) - len(tensor) :]
    indices = torch.tensor([index for index, _ in owned], dtype=torch.long)
    real = torch.tensor([is_real for _, is_real in owned], dtype=torch.bool)
    if grouped():
        tensor, indices, real = (all_gather_rows(t, device) for t in (tensor, indices, real))
    indices = indices[real.to(indices.device)]
    order = torch.argsort(indices, stable=True)
    # The ranks of one replica (tensor parallelism) read the same samples: each sample's rows count once.
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = indices[order][1:] != indices[order][:-1]
    return tensor[real.to(tensor.device)][order[first].to(tensor.device)]


class DistributedLoader:
    """Iterates this rank's shard of each epoch, on the engine's device; reshuffles every epoch by itself."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        num_workers: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        rank: int,
        world_size: int,
        grad_accum_steps: int,
        seed: int,
        device: torch.device,
        on_batch: Callable[[DistributedLoader, Batch], None] = lambda loader, batch: None,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"batch_size must be at least 1 (got {batch_size}); it is the per-device batch size.")
        if num_workers < 0:
            raise UsageError(f"num_workers must be 0 or more (got {num_workers}).")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.rank = rank
        self.world_size = world_size
        self.grad_accum_steps = grad_accum_steps
        self.seed = seed
        self.device = device
        self._on_batch = on_batch
        self.epoch = 0
        self.position = 0  # real samples of this epoch already handed out, counted over all ranks
        self._started = False  # a pass is under way (a new __iter__ before it ends abandons it)
        self.yielded: list[Batch] = []  # this epoch's batches so far on this rank, for Engine.gather

    def __len__(self) -> int:
        return len(self._plan(0))

    @property
    def samples_seen(self) -> int:
        """Real samples handed out so far, over every epoch and every rank."""
        return self.epoch * len(self.dataset) + self.position

    def batch_size_line(self) -> str:
        return batch_size_line(self.batch_size, self.grad_accum_steps, self.world_size)

    def next_step_samples(self) -> int:
        """The real samples (all ranks) of the optimizer step that starts at the current position: a whole window of
        global batches, or what is left of the epoch (the next epoch's first window at its very end)."""
        total, global_batch = len(self.dataset), self.batch_size * self.world_size
        start = self.position
        stop = total - (total - start) % global_batch if self.drop_last else total
        if start >= stop:  # the epoch is used up
            start, stop = 0, total - total % global_batch if self.drop_last else total
        return min(stop - start, global_batch * self.grad_accum_steps)

    def samples_in_steps(self, steps: int) -> int:
        """The real samples (all ranks) that the first `steps` optimizer steps of a run at this world size train on,
        over as many epochs as they take: a step budget turned into a position in the data."""
        per_step = [0]
        for batch in self._plan(0):  # every epoch splits the same way; only the order of samples differs
            per_step[-1] += batch.global_size
            if batch.ends_window:
                per_step.append(0)
        per_step.pop()
        epochs, rest = divmod(steps, len(per_step))
        return epochs * sum(per_step) + sum(per_step[:rest])

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _plan(self, start: int) -> list[Batch]:
        return plan_epoch(
            len(self.dataset),
            start,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            grad_accum_steps=self.grad_accum_steps,
            drop_last=self.drop_last,
            order=self._order(),
        )

    def __iter__(self) -> Iterator[Any]:
        if self._started:  # the previous pass was abandoned midway: its epoch counts as done
            self._advance()
        self._started = True
        self.yielded = []
        plan = self._plan(self.position)
        loader = DataLoader(
            self.dataset,
            batch_sampler=[batch.indices for batch in plan],
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.device.type == "cuda",
            worker_init_fn=_seed_numpy_in_worker,
            # Different random streams per rank and per epoch for augmentations in workers.
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.epoch),
        )
        for batch, data in zip(plan, loader, strict=True):
            self.position += batch.global_size
            self.yielded.append(batch)
            self._on_batch(self, batch)
            yield move_to(data, self.device)
        # A finished pass moves on at once, so `while loader.epoch < epochs: for batch in loader:` resumes right
        # even from a checkpoint taken at the very end of an epoch. `yielded` stays for Engine.gather.
        self._started = False
        self._advance()

    def _advance(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues the saved epoch at the saved sample position, whatever the world size now."""
        if bool(state["shuffle"]) != self.shuffle or state["seed"] != self.seed:
            raise UsageError(
                "The saved loader used another shuffle or seed, so its sample order cannot be continued; "
                "keep shuffle and seed as they were when resuming."
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._started = False
        self.yielded = []
        if self.position > 0 and not self._plan(self.position):  # saved at the very end of an epoch
            self._advance()


def _seed_numpy_in_worker(worker_id: int) -> None:
    # torch seeds `random` and itself in each worker, but not numpy: workers would share numpy's stream.
    np.random.seed(torch.initial_seed() % 2**32)


def map_tensors(data: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Applies `function` to every tensor inside nested dicts, lists, tuples, named tuples and dataclasses, and
    returns containers of the same types (a transformers ModelOutput stays one: recipes read `.loss`, `.logits`).

    Containers are copied, never changed in place: the data may be a batch the user's dataset keeps.
    """
    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, dict):
        if type(data) is dict:
            return {key: map_tensors(value, function) for key, value in data.items()}
        mapped = copy.copy(data)  # a dict subclass (ModelOutput, OrderedDict): its own __setitem__ keeps it whole
        for key, value in data.items():
            mapped[key] = map_tensors(value, function)
        return mapped
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        mapped = copy.copy(data)
        for field in dataclasses.fields(data):
            object.__setattr__(mapped, field.name, map_tensors(getattr(data, field.name), function))
        return mapped
    if isinstance(data, (list, tuple)):
        mapped = [map_tensors(value, function) for value in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    return data


def move_to(data: Any, device: torch.device) -> Any:
    return map_tensors(data, lambda tensor: tensor.to(device, non_blocking=device.type == "cuda"))
