"""A loader over data read as a stream of windows, whose global batches do not depend on the number of processes.

Data larger than memory is read in windows: window w of an epoch holds the same samples in the same order on
every rank and for every world size (a recipe reads records w*K..(w+1)*K of the stream, tokenises and packs
them). Every rank reads every window, since that takes no communication, and keeps one window in memory at a
time. Within a window the samples are permuted by (seed, epoch, window) when shuffling; global batches are
consecutive slices of the concatenated windows and rank r takes every W-th sample of a slice, as the in-memory
loader does. The stream is endless over epochs (epoch e+1 follows epoch e inside one global batch), so every
global batch is full and every rank runs the same steps: the recipes' --data-streaming stops it on a step budget.
An iterable dataset in a script's own loop gets EpochStreamLoader (multigpu.data.epoch_stream) instead, whose passes
end with the epochs, as torch's DataLoader's do.

The position (epoch, window, offset in the window) says nothing about the world size, so a run resumed at
another world size continues at the exact sample: every sample of every epoch is trained on exactly once.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from multigpu.core.errors import UsageError
from multigpu.core.tensor_trees import move_to
from multigpu.data.loader import Batch, DistributedLoader, LoaderBase, rank_positions


@runtime_checkable
class WindowedStream(Protocol):
    """Data read a window at a time: what `Engine.dataloader` streams instead of indexing."""

    def windows(self, epoch: int, first: int) -> Iterator[list[Any]]:
        """Successive windows of samples of `epoch`, from window index `first` on: window w must hold the same
        samples in the same order on every rank and for every world size. The iterator ends with the data.
        A stream whose windows depend on settings of its own (IterableStream's window and workers) names them in an
        `order_settings` dict of ints: saved with the position, and a resume with others is refused."""
        ...


class UnknownLength(UsageError, TypeError):
    """len() of a stream. A TypeError too, so that what only asks for a length hint (list(), tqdm) does without."""


@dataclass
class Cursor:
    """Where the next sample is: its epoch, its window, its offset in the window (permuted order), its position in
    the epoch, and how many samples came before it over all epochs. Nothing here depends on the world size."""

    epoch: int = 0
    window: int = 0
    offset: int = 0
    position: int = 0
    samples_seen: int = 0


class StreamLoader(LoaderBase):
    """Iterates this rank's share of each global batch of a WindowedStream, on the engine's device, epoch after
    epoch without end: the training loop stops it (a step budget, SampleSchedule.done)."""

    def __init__(self, dataset: WindowedStream, **settings: Any) -> None:
        """`settings`: LoaderBase's (batch_size, shuffle, num_workers, collate_fn, rank, world_size, ...); drop_last
        changes nothing: a stream without end has no short last batch to drop."""
        super().__init__(dataset, **settings)
        if self.num_workers != 0:
            raise UsageError(
                "A streamed dataset is read in the training process, so num_workers must be 0 (got "
                f"{self.num_workers}); do the expensive work (tokenising, packing) inside its windows()."
            )
        self._cursor = Cursor()
        self._micro_batches = 0  # since the start or the last load_state_dict, to know which one ends a window
        # self.yielded holds the last batch only (for Engine.gather and per-batch `.real`): a stream keeps no epoch.

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch handed out so far, counted over all ranks."""
        return self._cursor.position

    @property
    def samples_seen(self) -> int:
        """Samples handed out so far, over every epoch and every rank."""
        return self._cursor.samples_seen

    def __len__(self) -> int:
        raise UnknownLength(
            "A streamed dataset's length is not known before it is read, so a run over it needs a step budget; "
            "pass max steps (--max-steps) instead of epochs."
        )

    def batch_size_line(self) -> str:
        return super().batch_size_line() + " (streamed)"

    def next_step_samples(self) -> int:
        """The samples (all ranks) of every optimizer step: a stream's global batches are always full."""
        return self.batch_size * self.world_size * self.grad_accum_steps

    def samples_in_steps(self, steps: int) -> int:
        """The samples (all ranks) that `steps` optimizer steps at this world size train on."""
        return steps * self.next_step_samples()

    def __iter__(self) -> Iterator[Any]:
        """Batches from the saved position on. A pass left midway (a `break`) loses nothing: the next one carries on
        after the last batch yielded, as the position only moves when a batch is handed out."""
        global_batch = self.batch_size * self.world_size
        places = self._places()
        mine: list[Any] = []
        indices: list[int] = []
        filled = 0
        for sample, place, after in self._samples():
            if filled in places:
                mine.append(sample)
                indices.append(place)
            filled += 1
            if filled < global_batch:
                continue
            data = self.collate_fn(mine)
            mine, filled = [], 0  # the samples are released once collated
            self._cursor = after
            batch = self._batch(indices)
            indices = []
            self.yielded = [batch]
            self._on_batch(self, batch)
            yield move_to(data, self.device)
            places = self._places()  # the step that read the batch may have changed the shares (batch_shares auto)

    def _places(self) -> set[int]:
        """This rank's places in the next global batch."""
        return set(rank_positions(0, self.batch_size * self.world_size, self.rank, self.world_size, self.shares))

    def _batch(self, indices: list[int]) -> Batch:
        self._micro_batches += 1
        global_batch = self.batch_size * self.world_size
        return Batch(
            indices=indices,
            real=len(indices),
            global_size=global_batch,
            # Every batch is full: each weighs 1 / grad_accum_steps, the weights of the in-memory loader's full ones.
            weight=len(indices) * self.world_size / (global_batch * self.grad_accum_steps),
            ends_window=self._micro_batches % self.grad_accum_steps == 0,
        )

    def _samples(self) -> Iterator[tuple[Any, int, Cursor]]:
        """Every sample from the position on, over epoch after epoch: (sample, its place in the whole stream, the
        cursor just after it). The place counts across epochs (a global batch may hold the end of one and the start of
        the next), so it orders and tells apart every sample of a batch, as Engine.gather needs."""
        cursor = self._cursor
        while True:
            seen = yield from self._epoch_samples(cursor)
            cursor = Cursor(cursor.epoch + 1, samples_seen=seen)

    def _epoch_samples(self, start: Cursor) -> Generator[tuple[Any, int, Cursor], None, int]:
        """The samples of `start`'s epoch from it to the epoch's end, as `_samples` gives them; returns the samples
        seen over all epochs at its end. One window is held at a time: the last is let go before the stream makes the
        next."""
        epoch, first, offset = start.epoch, start.window, start.offset
        position, seen = start.position, start.samples_seen
        held_any = False  # a window of this epoch had samples (read now, or before the saved position)
        windows = self.dataset.windows(epoch, first)
        window_index = first
        while (window := next(windows, None)) is not None:
            if offset > len(window):
                raise UsageError(
                    f"The saved stream position (epoch {epoch}, window {window_index}, sample {offset}) lies past "
                    f"the end of that window of {len(window)} samples; resume with the data and settings the "
                    "checkpoint was made with."
                )
            held_any = held_any or len(window) > 0
            order = self._order(epoch, window_index, len(window))
            for i in range(offset, len(window)):
                position, seen = position + 1, seen + 1
                yield window[order[i]], seen - 1, Cursor(epoch, window_index, i + 1, position, seen)
            window = order = None  # let the window go before the stream reads the next
            window_index, offset = window_index + 1, 0
        if not held_any and first == 0:
            raise UsageError(
                f"The streamed dataset gave no samples for epoch {epoch}; check that the data it reads is not empty."
            )
        return seen

    def _order(self, epoch: int, window: int, size: int) -> list[int]:
        if not self.shuffle:
            return list(range(size))
        # A generator of its own per window, from (seed, epoch, window): no two windows share a permutation stream.
        generator = np.random.default_rng([self.seed % 2**63, epoch, window])
        return generator.permutation(size).tolist()

    def state_dict(self) -> dict[str, int]:
        cursor = self._cursor
        return {
            "epoch": cursor.epoch,
            "window": cursor.window,
            "offset": cursor.offset,
            "position": cursor.position,
            "samples_seen": cursor.samples_seen,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            **self._order_settings(),
        }

    def _order_settings(self) -> dict[str, int]:
        """What besides the position decides the windows (an IterableStream's window and workers), as saved."""
        return {f"stream_{name}": value for name, value in getattr(self.dataset, "order_settings", {}).items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues at the saved sample, whatever the world size now."""
        if "window" not in state:
            raise UsageError(
                "The saved loader state is an in-memory loader's, not a stream's; resume a streamed run from a "
                "checkpoint of a streamed run (or load the data in memory as it was)."
            )
        self._check_order(state)
        saved = {name: value for name, value in state.items() if name.startswith("stream_")}
        now = self._order_settings()
        if saved != now:
            raise UsageError(
                f"The saved stream position belongs to a stream read {_spelled(saved)}, but this one is read "
                f"{_spelled(now)}, which puts other samples there; resume with the window and num_workers of the run "
                "that saved it."
            )
        names = ("epoch", "window", "offset", "position", "samples_seen")
        self._cursor = Cursor(*(int(state[name]) for name in names))
        self._micro_batches = 0
        self.yielded = []


def _spelled(settings: dict[str, int]) -> str:
    """How a stream's windows were made: 'in windows of 1024 samples by 2 workers', or by windows() of its own."""
    if "stream_window" not in settings:
        return "by a windows() of its own"
    workers = settings.get("stream_workers", 0)
    by = f"by {workers} DataLoader workers" if workers else "in the training process"
    return f"in windows of {settings['stream_window']} samples {by}"


#: Either loader the Engine makes: the same interface (SampleSchedule, checkpoints and the Engine read it).
Loader = DistributedLoader | StreamLoader
