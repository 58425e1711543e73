"""Iterable datasets (a torch IterableDataset, a Hugging Face streaming dataset, a webdataset pipeline) read as
streams whose global batches do not depend on the number of processes.

Every rank reads the whole stream, in the same order, and keeps its share of each global batch (EpochStreamLoader):
no communication, and N processes train on exactly the samples one process trains on, batch for batch. As with
torch's DataLoader, a `for` over the loader ends at the end of each epoch of the stream (a short last global batch
split as the in-memory loader splits one), so `for epoch in range(E): for batch in loader:` ends. The stream is
cut into windows of `window` consecutive samples, the unit of the shuffle (a stream cannot be permuted as a whole,
so samples are permuted within a window) and of a position. Epoch e reads the dataset again, after
`dataset.set_epoch(e)` where it has one (Hugging Face's reshuffle their shards by it). A position is (epoch,
window, offset), none of it depending on the world size, so a run resumes at another world size at the exact
sample: the dataset is read up to it and what comes before is dropped (a Hugging Face dataset skips there itself in
its first epoch, without turning the records it skips into samples).

With num_workers > 0 a torch DataLoader's workers read the dataset, each the part `get_worker_info()` gives it (as
Hugging Face datasets and webdataset split their shards), `window` samples at a time; the windows are the workers'
in turn. That order depends on the number of workers, the same on every rank, so the position saves it.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from multigpu.core.errors import UsageError
from multigpu.data.epoch_stream import EpochStreamLoader
from multigpu.data.loader import DistributedLoader
from multigpu.data.stream import Loader, StreamLoader, WindowedStream

#: Samples per window: the shuffle permutes within one, and memory holds about one (plus the workers' in flight).
WINDOW = 1024


def is_iterable_dataset(dataset: Any) -> bool:
    """A dataset to read in order rather than index: a torch IterableDataset (Hugging Face's streaming datasets are
    one), or anything iterable without a length. A dataset with a length and `__getitem__` stays map-style."""
    if isinstance(dataset, IterableDataset):
        return True
    return isinstance(dataset, Iterable) and not hasattr(dataset, "__len__")


@dataclass(frozen=True)
class IterableStream:
    """An iterable dataset as a WindowedStream: windows of `window` samples in the order the dataset gives them
    (read by `num_workers` DataLoader workers, if any). Pass one to `engine.dataloader` to choose the window."""

    dataset: Any
    window: int = WINDOW
    num_workers: int = 0
    seed: int = 0  # the workers' random seeds come from it and the epoch: the same on every rank

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UsageError(f"The window of an IterableStream must be at least 1 sample (got {self.window}).")
        if self.num_workers < 0:
            raise UsageError(f"num_workers must be 0 or more (got {self.num_workers}).")
        if isinstance(self.dataset, Iterator):
            raise UsageError(
                "A generator or iterator can be read only once, but a stream is read again every epoch and on every "
                "resume; hand engine.dataloader an object whose __iter__ starts the stream anew (a torch "
                "IterableDataset)."
            )
        if getattr(self.dataset, "_distributed", None) is not None:  # Hugging Face's split_dataset_by_node
            raise UsageError(
                "This dataset is one rank's part (split_dataset_by_node), but every rank must read the whole stream "
                "and keep its own share of each batch; hand engine.dataloader the dataset before the split."
            )

    @property
    def order_settings(self) -> dict[str, int]:
        """What besides the position decides which sample is where: saved with the position and checked on resume."""
        return {"window": self.window, "workers": self.num_workers}

    def windows(self, epoch: int, first: int) -> Iterator[list[Any]]:
        """Windows of `epoch` from window `first` on (a resume), read from the dataset's start in that epoch."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if self.num_workers:
            return itertools.islice(self._by_workers(epoch), first, None)
        return self._in_process(epoch, first * self.window)

    def _in_process(self, epoch: int, skip: int) -> Iterator[list[Any]]:
        if skip and epoch == 0 and skips_itself(self.dataset):
            samples = iter(self.dataset.skip(skip))
        else:
            samples = itertools.islice(iter(self.dataset), skip, None)  # read and dropped
        while window := list(itertools.islice(samples, self.window)):
            yield window

    def _by_workers(self, epoch: int) -> Iterator[list[Any]]:
        dataset = self.dataset if isinstance(self.dataset, IterableDataset) else _Iterated(self.dataset)
        reader = DataLoader(
            dataset,
            batch_size=self.window,
            collate_fn=list,
            num_workers=self.num_workers,  # their windows in turn (in_order), however fast each worker is
            worker_init_fn=_seed_numpy_in_worker,
            generator=torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63),
        )
        windows = iter(reader)
        head = list(itertools.islice(windows, 2))
        if self.num_workers > 1 and len(head) == 2 and _same(*head, self.window):
            raise UsageError(
                f"DataLoader workers 0 and 1 read the same first {self.window} samples, so this dataset gives each "
                "worker the whole stream; split its reading by torch.utils.data.get_worker_info() or pass "
                "num_workers=0."
            )
        yield from head
        yield from windows


def skips_itself(dataset: Any) -> bool:
    """A Hugging Face IterableDataset, whose `skip(n)` passes over records without decoding them: in epoch 0 its
    stream is the dataset's from the n-th sample on (later epochs reshuffle shards, which `skip` holds still)."""
    return type(dataset).__module__.startswith("datasets.") and callable(getattr(dataset, "skip", None))


def _same(first: list[Any], second: list[Any], window: int) -> bool:
    """Two full windows with the same samples (compared as pickled, how the workers sent them)."""
    return len(first) == len(second) == window and pickle.dumps(first) == pickle.dumps(second)


class _Iterated(IterableDataset):
    """An iterable that is no torch IterableDataset, as one, so that DataLoader workers iterate it."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def _seed_numpy_in_worker(worker_id: int) -> None:
    # torch seeds `random` and itself in each worker from the DataLoader's generator, but not numpy.
    np.random.seed(torch.initial_seed() % 2**32)


def make_loader(dataset: Any, *, num_workers: int, seed: int, **settings: Any) -> Loader:
    """The loader for `dataset`: an iterable dataset streams a pass per epoch (EpochStreamLoader), a WindowedStream
    of its own (the recipes' --data-streaming) streams without end (StreamLoader: a step budget stops it), anything
    else is indexed (DistributedLoader). `settings`: LoaderBase's others (batch_size, shuffle, rank, ...)."""
    if isinstance(dataset, IterableStream):
        stream = replace(dataset, num_workers=num_workers or dataset.num_workers, seed=seed)
    elif isinstance(dataset, WindowedStream):
        return StreamLoader(dataset, num_workers=num_workers, seed=seed, **settings)
    elif is_iterable_dataset(dataset):
        stream = IterableStream(dataset, num_workers=num_workers, seed=seed)
    else:
        return DistributedLoader(dataset, num_workers=num_workers, seed=seed, **settings)
    return EpochStreamLoader(stream, num_workers=0, seed=seed, **settings)  # the workers are the stream's
