"""A streamed loader whose passes end with the stream's epochs: an iterable dataset in a script's own loop.

torch's DataLoader over an IterableDataset ends a `for` at the stream's end, and scripts are shaped by it:
`for epoch in range(E): for batch in loader:`. StreamLoader never ends (the recipes stop it on a step budget), so
such a script would train forever without a word. EpochStreamLoader reads as StreamLoader does (every rank the whole
stream, keeping its share of each global batch), but a pass yields the batches from the position to its epoch's
end and stops; the next `for` reads the next epoch. A `break` loses nothing: the next `for` carries on after the
last batch handed out, in the same epoch.

An epoch's last global batch may be short. It is split as the in-memory loader splits one (EpochPlan): as evenly as
possible (or by the shares), and where it has fewer samples than ranks, each rank left over gets one padding sample
of weight zero; drop_last drops it. `Batch.weight = real * world / window_samples` makes each optimizer step's
gradient the mean over its real samples, whatever the split. Every rank reads the same stream, so every rank meets
the end at the same sample and runs the same number of steps.

The weight of an accumulation window's first micro-batch needs the window's sample count, which at an epoch's end
only reading on tells: a pass reads a window's global batches, and the one after them, before handing out the first.
It holds this rank's part of each, collated (grad_accum_steps + 1 batches of memory), and of the batch being read
only the samples that may be its own (all of them where batch shares split it). The batch after a window also tells
whether the window ends the epoch, so a state saved after the epoch's last batch resumes at the next epoch's start,
as the in-memory loader's does, and the next `for` begins there without reading the stream to find it.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

from multigpu.core.errors import UsageError
from multigpu.core.tensor_trees import move_to
from multigpu.data.loader import Batch, EpochPlan
from multigpu.data.stream import Cursor, StreamLoader, UnknownLength, WindowedStream


@dataclass
class _Part:
    """This rank's part of one global batch, read ahead of its step: collated, and where its samples sit."""

    data: Any
    indices: list[int]  # the stream places of its samples (a padding sample's is its batch's first)
    real: int  # samples that are not padding
    size: int  # real samples in the whole global batch
    after: Cursor  # the position after the global batch


class EpochStreamLoader(StreamLoader):
    """Iterates this rank's share of each global batch of a WindowedStream, on the engine's device, to the end of the
    position's epoch: a `for` over it ends with the epoch, the next reads the next epoch."""

    def __init__(self, dataset: WindowedStream, **settings: Any) -> None:
        """`settings`: StreamLoader's; drop_last drops an epoch's short last global batch."""
        super().__init__(dataset, **settings)
        self._ended = False  # the epoch's last batch is handed out: the next pass, and a saved state, begin the next
        self._in_window = 0  # micro-batches of the accumulation window under way handed out (a `break` may split one)
        self._window_before = 0  # their real samples, all ranks together

    def __len__(self) -> int:
        raise UnknownLength(
            "An iterable dataset's length is not known before it is read, so its loader has no len(); a `for` over "
            "the loader ends at the end of each epoch of the stream."
        )

    def next_step_samples(self) -> int:
        """A full window's samples: an epoch's short last step shows only when read, so a SampleSchedule gives it the
        lr of a full one (the same at any world size)."""
        return super().next_step_samples()

    def samples_in_steps(self, steps: int) -> int:
        """The samples of `steps` full optimizer steps: an upper bound, as epochs' last steps may be short."""
        return super().samples_in_steps(steps)

    def __iter__(self) -> Iterator[Any]:
        """The batches from the position to its epoch's end, each handed out once its window is read."""
        parts, ahead = self._start()
        while ahead:
            need = self.grad_accum_steps - self._in_window  # the window's batches still to hand out
            ahead.extend(itertools.islice(parts, need + 1 - len(ahead)))  # ...and the batch after them, if any
            window = collections.deque(ahead.popleft() for _ in range(min(need, len(ahead))))
            ends_epoch = not ahead
            window_samples = self._window_before + sum(part.size for part in window)
            while window:
                part = window.popleft()  # let go once handed out
                yield self._hand_out(part, window_samples, ends_window=not window, ends_epoch=ends_epoch and not window)
        self._next_epoch()  # a finished pass moves on at once: `while loader.epoch < epochs: for batch in loader:`

    def _start(self) -> tuple[Iterator[_Part], collections.deque[_Part]]:
        """The pass's parts, and its first read ahead: in the position's epoch, or the next where that one is over."""
        if self._ended:
            self._next_epoch()
        parts = self._parts()
        ahead = collections.deque(itertools.islice(parts, 1))  # read, not yet handed out
        if not ahead and self._cursor.position > 0:  # a position at its epoch's very end (a StreamLoader's state)
            self._next_epoch()
            parts = self._parts()
            ahead.extend(itertools.islice(parts, 1))
        if not ahead:
            raise UsageError(
                f"drop_last leaves no batch in epoch {self.epoch} of the stream: it has fewer samples than a global "
                f"batch of {self.batch_size * self.world_size}; use a smaller batch size or drop_last=False."
            )
        return parts, ahead

    def _hand_out(self, part: _Part, window_samples: int, ends_window: bool, ends_epoch: bool) -> Any:
        """Moves the position past `part`'s global batch and tells the engine its weight; returns its data."""
        batch = Batch(
            indices=part.indices,
            real=part.real,
            global_size=part.size,
            weight=part.real * self.world_size / window_samples,
            ends_window=ends_window,
        )
        self._cursor, self._ended = part.after, ends_epoch
        if ends_window:
            self._in_window, self._window_before = 0, 0
        else:
            self._in_window, self._window_before = self._in_window + 1, self._window_before + part.size
        self.yielded = [batch]
        self._on_batch(self, batch)
        return move_to(part.data, self.device)

    def _parts(self) -> Iterator[_Part]:
        """This rank's part of each global batch of the position's epoch from the position on, the short last one
        too unless drop_last. Each is split when read, by the shares then: every rank reads as far ahead, so every
        rank splits each batch alike (batch_shares auto changes the split of the batches not yet read)."""
        global_batch = self.batch_size * self.world_size
        samples = self._epoch_samples(self._cursor)
        while True:
            shares = self.shares
            held, size, after = self._read_batch(samples, shares)
            if size == 0 or (size < global_batch and self.drop_last):
                return
            part, held = self._split(held, size, after, shares), {}  # the raw samples go once split
            yield part
            if size < global_batch:
                return

    def _read_batch(
        self, samples: Iterator[tuple[Any, int, Cursor]], shares: tuple[float, ...] | None
    ) -> tuple[dict[int, tuple[Any, int]], int, Cursor]:
        """The next global batch's samples that may be this rank's, as (sample, place) by place in the batch; its
        size (short at the epoch's end); the position after it."""
        keep = self._kept(shares)
        held: dict[int, tuple[Any, int]] = {}
        size, after = 0, self._cursor
        for sample, place, cursor in itertools.islice(samples, self.batch_size * self.world_size):
            if size in keep:
                held[size] = (sample, place)
            size, after = size + 1, cursor
        return held, size, after

    def _kept(self, shares: tuple[float, ...] | None) -> Container[int]:
        """The places of a global batch that may be this rank's, whatever size it turns out to have: its every
        world-th and the first (a padding sample); split by shares, whose runs move with the size, all of them."""
        global_batch = self.batch_size * self.world_size
        if shares is not None:
            return range(global_batch)
        return {*range(self.rank, global_batch, self.world_size), 0}

    def _split(
        self, held: dict[int, tuple[Any, int]], size: int, after: Cursor, shares: tuple[float, ...] | None
    ) -> _Part:
        """This rank's part of a global batch of `size` samples, split as the in-memory loader splits one."""
        plan = EpochPlan(
            size,
            0,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            grad_accum_steps=1,
            drop_last=False,
            order=None,
            shares=shares,
        )
        split = plan[0]  # its positions in the batch, and how many are real
        mine = [held[position] for position in split.indices]
        data = self.collate_fn([sample for sample, _ in mine])
        return _Part(data, [place for _, place in mine], split.real, size, after)

    def _next_epoch(self) -> None:
        self._cursor = Cursor(self._cursor.epoch + 1, samples_seen=self._cursor.samples_seen)
        self._ended, self._in_window, self._window_before = False, 0, 0

    def state_dict(self) -> dict[str, int]:
        """The position; after an epoch's last batch, the next epoch's start (so `loader.epoch` counts it done)."""
        state = super().state_dict()
        if self._ended:
            state.update(epoch=self._cursor.epoch + 1, window=0, offset=0, position=0)
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues at the saved sample, whatever the world size now; accumulation windows count from there."""
        super().load_state_dict(state)
        self._ended, self._in_window, self._window_before = False, 0, 0
