"""A distributed loader whose global batches do not depend on the number of processes.

Every epoch is one permutation of the dataset, the same on every rank and for every world size (it depends on
seed, epoch and the dataset's length only). Global batches are consecutive slices of it; each rank takes every
W-th sample of a slice. So N processes see exactly the samples one process sees, batch for batch, and a run
resumed at another world size carries on from the same position in the same permutation: nothing repeated,
nothing skipped.

Nothing is planned ahead: each batch's samples are computed from its position when it is needed (the permutation
is evaluated per index, `multigpu.data.shuffle`), so the first batch comes as fast at 10^9 samples as at 10, and
`len()` and step counts are arithmetic.

With batch shares (one weight per rank, for ranks of different speeds), rank r takes a consecutive run of each
global batch instead, its share of it (multigpu.config.layout.split_by_shares): the same global batches, split
otherwise.
The shares may change during a pass (batch_shares auto): the new ones split the batches not yet planned (the
DataLoader's workers plan a few ahead, and every rank as many), and `SplitChanges` keeps which batch each split
began at, so the pass's batches can still be recomputed.

The last global batch of an epoch may be short. It is split as evenly as possible (by the shares, if any); when
it has fewer samples than there are ranks, the ranks left over get one *padding* sample whose loss weight is zero
(every rank must run the same number of steps, or the collectives hang). `Batch.weight` makes the gradient of each
optimizer step the mean over the real samples of its global batch, whatever the split.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from multigpu.config.layout import split_by_shares
from multigpu.core.env import all_gather_rows, grouped
from multigpu.core.errors import UsageError
from multigpu.core.tensor_trees import move_to
from multigpu.data.shuffle import Permutation

#: The version of the shuffled order, saved with the loader's position: a position means nothing in another order.
#: 1 (never written down) was a torch.randperm per epoch; 2 is `Permutation`.
ORDER = 2


@dataclass(frozen=True)
class Batch:
    """Where a rank's batch sits in the epoch, and how much its mean loss counts."""

    indices: list[int]  # dataset indices this rank loads (padding included)
    real: int  # how many of them are real samples; the rest are padding
    global_size: int  # real samples across all ranks in this global batch
    weight: float  # multiplies the rank's mean loss so DDP's average becomes the window's sample mean
    ends_window: bool  # the last micro-batch of an optimizer step


@dataclass(frozen=True)
class EpochPlan(Sequence[Batch]):
    """This rank's batches from sample position `start` of an epoch to its end, each computed when asked for.

    Global batch k holds positions start + k*G .. of the epoch's order (G = batch_size x world_size), cut at the
    epoch's end (or before the short last one with drop_last); accumulation windows of grad_accum_steps batches
    count from `start`, as a resumed run's first step does.
    """

    samples: int
    start: int
    rank: int
    world_size: int
    batch_size: int
    grad_accum_steps: int
    drop_last: bool
    order: Permutation | None  # None: the dataset's own order
    shares: tuple[float, ...] | None = None  # each rank's weight in the split of a global batch; None: even
    changes: SplitChanges | None = None  # the shares from a batch on, where they change during the pass
    global_batch: int = field(init=False)
    stop: int = field(init=False)
    _count: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Fixed for the plan's life and read at every batch: computed once (a batch's cost is a step's).
        global_batch = self.batch_size * self.world_size
        short = (self.samples - self.start) % global_batch
        stop = self.samples - short if self.drop_last else self.samples
        object.__setattr__(self, "global_batch", global_batch)
        object.__setattr__(self, "stop", stop)  # where the batches end: the end, or before a dropped short batch
        object.__setattr__(self, "_count", max(0, -(-(stop - self.start) // global_batch)))

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k: int) -> Batch:  # type: ignore[override]
        count, global_batch = self._count, self.global_batch
        k = k + count if k < 0 else k
        if not 0 <= k < count:
            raise IndexError(f"batch {k} of {count}")
        first = self.start + k * global_batch
        size = min(global_batch, self.stop - first)
        shares, among = (self.shares, None) if self.changes is None else self.changes.at(k)
        rank, world = among or (self.rank, self.world_size)
        if size >= world:
            positions = rank_positions(first, size, rank, world, shares)
            real = len(positions)
        else:  # fewer samples than ranks: one each, and the ranks left over repeat the first as padding
            positions = range(first + rank, first + rank + 1) if rank < size else range(first, first + 1)
            real = int(rank < size)
        window_first = self.start + k // self.grad_accum_steps * self.grad_accum_steps * global_batch
        window_samples = min(window_first + self.grad_accum_steps * global_batch, self.stop) - window_first
        indices = list(positions) if self.order is None else self.order(positions).tolist()
        return Batch(
            indices=indices,
            real=real,
            global_size=size,
            weight=real * world / window_samples,
            ends_window=k % self.grad_accum_steps == self.grad_accum_steps - 1 or k == count - 1,
        )


def rank_positions(first: int, size: int, rank: int, world: int, shares: tuple[float, ...] | None) -> range:
    """`rank`'s positions of a global batch of `size` samples (at least `world`) from position `first`: every
    world-th, or its consecutive run by the shares."""
    if shares is None:
        return range(first + rank, first + size, world)
    parts = split_by_shares(size, shares)
    begin = first + sum(parts[:rank])
    return range(begin, begin + parts[rank])


#: (rank, ranks) that split a global batch instead of the loader's own: under fault tolerance, this rank's place
#: among the replica groups alive at a step, which train the whole global batch of every replica group together.
Among = tuple[int, int] | None


class SplitChanges:
    """How each batch of a pass is split: by `shares` among the loader's ranks from batch 0, and each change (of
    shares, or of the ranks that split it) from the batch it began at, for every batch after it until the next."""

    def __init__(self, shares: tuple[float, ...] | None, among: Among = None) -> None:
        self.starts: list[int] = [0]
        self.splits: list[tuple[tuple[float, ...] | None, Among]] = [(shares, among)]

    def at(self, k: int) -> tuple[tuple[float, ...] | None, Among]:
        return self.splits[bisect.bisect_right(self.starts, k) - 1]

    def change(self, k: int, shares: tuple[float, ...] | None, among: Among = None) -> None:
        # The changes from batch k on are replaced: nothing was split by them yet, or a step run again replans.
        keep = bisect.bisect_left(self.starts, k)
        del self.starts[keep:], self.splits[keep:]
        self.starts.append(k)
        self.splits.append((shares, among))


class Yielded(Sequence[Batch]):
    """The batches a pass has handed out so far, recomputed from its plan when read: O(1) memory per epoch."""

    def __init__(self, plan: EpochPlan) -> None:
        self.plan = plan
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> Batch:  # type: ignore[override]
        k = k + self.count if k < 0 else k
        if not 0 <= k < self.count:
            raise IndexError(f"batch {k} of the {self.count} yielded")
        return self.plan[k]


def batch_size_line(batch: int, accum: int, world: int) -> str:
    """The global batch a loader makes, spelled out."""
    return (
        f"effective batch size {batch * accum * world} = {batch} per device x "
        f"{accum} accumulation step{'s' if accum > 1 else ''} x {world} process{'es' if world > 1 else ''}"
    )


def gather_in_order(tensor: torch.Tensor, batches: Sequence[Batch], device: torch.device) -> torch.Tensor:
    """Every rank's rows of `tensor`, padding removed, in dataset order: `tensor`'s rows belong to the last
    `len(tensor)` samples in `batches`, what this rank's loader yielded this epoch."""
    owned: list[tuple[int, bool]] = []  # (index, real) of the last samples, newest first
    for k in range(len(batches) - 1, -1, -1):
        if len(owned) >= len(tensor):
            break  # only the batches the rows belong to are read back
        batch = batches[k]
        owned += [(index, i < batch.real) for i, index in reversed(list(enumerate(batch.indices)))]
    if len(tensor) > len(owned):
        raise UsageError(
            f"gather got {len(tensor)} rows but this rank's loader has yielded {len(owned)} samples this "
            "epoch; gather the outputs of samples from engine.dataloader."
        )
    owned = owned[: len(tensor)][::-1]
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


class LoaderBase:
    """What the in-memory and the streamed loader share: their settings, and the check of a saved order."""

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        shuffle: bool,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        rank: int,
        world_size: int,
        grad_accum_steps: int,
        seed: int,
        device: torch.device,
        on_batch: Callable[[Any, Batch], None] = lambda loader, batch: None,
        shares: tuple[float, ...] | None = None,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"batch_size must be at least 1 (got {batch_size}); it is the per-device batch size.")
        if num_workers < 0:
            raise UsageError(f"num_workers must be 0 or more (got {num_workers}).")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last  # an epoch's short last global batch; an endless stream has none to drop
        self.num_workers = num_workers
        self.collate_fn = collate_fn if collate_fn is not None else default_collate  # the DataLoader's own default
        self.rank = rank
        self.world_size = world_size
        self.grad_accum_steps = grad_accum_steps
        self.seed = seed
        self.device = device
        self._on_batch = on_batch
        self.shares = shares  # each rank's weight in the split of a global batch (None: even)
        self.yielded: Sequence[Batch] = ()  # this epoch's batches so far on this rank, for Engine.gather

    def set_shares(self, shares: tuple[float, ...]) -> None:
        """Splits the global batches not yet read (or planned) by `shares` from now on (batch_shares auto)."""
        self.shares = shares

    def batch_size_line(self) -> str:
        line = batch_size_line(self.batch_size, self.grad_accum_steps, self.world_size)
        if self.shares is None:
            return line
        parts = split_by_shares(self.batch_size * self.world_size, self.shares)
        return f"{line}, split {':'.join(map(str, parts))} by batch_shares {','.join(f'{w:g}' for w in self.shares)}"

    def _check_order(self, state: dict[str, int]) -> None:
        if bool(state["shuffle"]) != self.shuffle or state["seed"] != self.seed:
            raise UsageError(
                "The saved loader used another shuffle or seed, so its sample order cannot be continued; "
                "keep shuffle and seed as they were when resuming."
            )


class DistributedLoader(LoaderBase):
    """Iterates this rank's shard of each epoch, on the engine's device; reshuffles every epoch by itself."""

    def __init__(self, dataset: Dataset, **settings: Any) -> None:
        """`settings`: LoaderBase's (batch_size, shuffle, drop_last, num_workers, collate_fn, rank, world_size, ...)."""
        super().__init__(dataset, **settings)
        self.epoch = 0
        self.position = 0  # real samples of this epoch already handed out, counted over all ranks
        self._started = False  # a pass is under way (a new __iter__ before it ends abandons it)
        self._sampler: _Sampler | None = None  # the pass's, while one is under way
        # Fault tolerance (engine/replicas.py): called as each window's first batch is planned, to split it among
        # the replica groups alive (set_split) or to carry on from a healed position (load_state_dict).
        self.before_window: Callable[[], None] | None = None
        self.among: Among = None
        self._window_start = (0, 0)  # (epoch, position) where the window under way began

    def set_shares(self, shares: tuple[float, ...]) -> None:
        super().set_shares(shares)
        if self._sampler is not None:
            self._sampler.plan.changes.change(self._sampler.planned, shares, self.among)  # type: ignore[union-attr]

    def set_split(self, among: Among) -> None:
        """Splits the global batches not yet planned among `among` = (this rank, ranks) instead of the loader's
        own rank and world size (None: those again)."""
        self.among = among
        if self._sampler is not None:
            self._sampler.plan.changes.change(self._sampler.planned, self.shares, among)  # type: ignore[union-attr]

    def rewind_window(self) -> None:
        """Hands out the window under way again from its first batch: a step whose commit failed runs again on the
        same global batch."""
        self.epoch, self.position = self._window_start
        if self._sampler is not None:
            self._sampler.restart()

    def __len__(self) -> int:
        return len(self._plan(0))

    @property
    def samples_seen(self) -> int:
        """Real samples handed out so far, over every epoch and every rank."""
        return self.epoch * len(self.dataset) + self.position

    def next_step_samples(self) -> int:
        """The real samples (all ranks) of the optimizer step that starts at the current position: a whole window of
        global batches, or what is left of the epoch (the next epoch's first window at its very end)."""
        plan = self._plan(self.position)
        if not plan:  # the epoch is used up
            plan = self._plan(0)
        return min(plan.stop - plan.start, plan.global_batch * self.grad_accum_steps)

    def samples_in_steps(self, steps: int) -> int:
        """The real samples (all ranks) that the first `steps` optimizer steps of a run at this world size train on,
        over as many epochs as they take: a step budget turned into a position in the data."""
        plan = self._plan(0)  # every epoch splits the same way; only the order of samples differs
        if not plan:
            raise UsageError(
                f"drop_last leaves no batch of {plan.global_batch} samples in a dataset of {plan.samples}; "
                "use a smaller batch size or drop_last=False."
            )
        window = plan.global_batch * self.grad_accum_steps  # every window is full but an epoch's last
        epochs, rest = divmod(steps, -(-len(plan) // self.grad_accum_steps))
        return epochs * plan.stop + rest * window

    def _plan(self, start: int) -> EpochPlan:
        n = len(self.dataset)
        return EpochPlan(
            n,
            start,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            grad_accum_steps=self.grad_accum_steps,
            drop_last=self.drop_last,
            order=Permutation(n, self.seed, self.epoch) if self.shuffle and n > 0 else None,
            shares=self.shares,
        )

    def __iter__(self) -> Iterator[Any]:
        if self._started:  # the previous pass was abandoned midway: its epoch counts as done
            self._advance()
        self._started = True
        pending: collections.deque[Batch] = collections.deque()  # planned for the DataLoader, not yet yielded
        self._sampler = _Sampler(self, pending)
        loader = DataLoader(
            self.dataset,
            batch_sampler=self._sampler,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.device.type == "cuda",
            worker_init_fn=_seed_numpy_in_worker,
            # Different random streams per rank and per epoch for augmentations in workers.
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.epoch),
        )
        for data in loader:
            batch = pending.popleft()
            self.position += batch.global_size
            self.yielded.count += 1  # type: ignore[attr-defined]
            self._on_batch(self, batch)
            yield move_to(data, self.device)
        # A finished pass moves on at once, so `while loader.epoch < epochs: for batch in loader:` resumes right
        # even from a checkpoint taken at the very end of an epoch. `yielded` stays for Engine.gather.
        self._started, self._sampler = False, None
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
            "order": ORDER,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues the saved epoch at the saved sample position, whatever the world size now."""
        if "window" in state:
            raise UsageError(
                "The saved loader state is a stream's, not an in-memory loader's; resume an in-memory run from a "
                "checkpoint of an in-memory run (or stream the data as it was)."
            )
        self._check_order(state)
        # Unshuffled, every version reads the dataset in its own order: only a shuffled position needs this order.
        if self.shuffle and state.get("order") != ORDER:
            raise UsageError(
                "This checkpoint's loader position is in the shuffled order of an earlier multigpu version, which "
                "this one no longer makes; finish that run with the multigpu version that started it, or start anew."
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self._sampler is not None:  # healed from a live replica group inside a pass: it goes on from there
            self._sampler.restart()
            return
        self._started = False
        self.yielded = ()
        if self.position > 0 and not self._plan(self.position):  # saved at the very end of an epoch
            self._advance()


class _Sampler:
    """The DataLoader's batches of a pass, each computed as the DataLoader asks for it (its workers may ask a few
    ahead), and queued for the loop that yields them."""

    def __init__(self, loader: DistributedLoader, pending: collections.deque[Batch]) -> None:
        self.loader, self.pending = loader, pending
        self.restart()

    def restart(self) -> None:
        """Plans the pass from the loader's position on: at its start, or where a window runs again or a healed
        replica group carries on."""
        loader = self.loader
        self.plan = replace(loader._plan(loader.position), changes=SplitChanges(loader.shares, loader.among))
        self.planned = 0  # batches computed so far: a change of split applies from the next
        self.pending.clear()
        loader.yielded = Yielded(self.plan)

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[int]]:
        loader = self.loader
        while self.planned < len(self.plan):
            if self.planned % self.plan.grad_accum_steps == 0:
                if loader.before_window is not None:
                    loader.before_window()  # may split otherwise from here, or restart the plan elsewhere
                    if self.planned >= len(self.plan):
                        return
                loader._window_start = (loader.epoch, loader.position)
            batch = self.plan[self.planned]
            self.planned += 1
            self.pending.append(batch)
            yield batch.indices


def _seed_numpy_in_worker(worker_id: int) -> None:
    # torch seeds `random` and itself in each worker, but not numpy: workers would share numpy's stream.
    np.random.seed(torch.initial_seed() % 2**32)
