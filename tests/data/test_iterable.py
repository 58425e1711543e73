"""Iterable datasets through the streamed loader, in one process: the windows an IterableStream cuts, the global
batches a loader per rank makes at 1, 2 and 3 ranks, a `for` per epoch ending at the stream's end with a short last
batch (padded, weighted), breaks and resumes at another world size, DataLoader workers, Hugging Face streaming
datasets over JSON lines files, and the refusals. test_iterable_engine.py trains on them in real processes.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset, get_worker_info

from multigpu.core.errors import UsageError
from multigpu.data.epoch_stream import EpochStreamLoader
from multigpu.data.iterable import IterableStream, is_iterable_dataset, make_loader
from multigpu.data.loader import Batch, DistributedLoader
from multigpu.data.stream import StreamLoader

SAMPLES = 23  # a stream of 23 samples: windows of 5 leave a short last one, global batches of 6 a short last one
WINDOW, SEED, GLOBAL = 5, 3, 6


class Numbers(IterableDataset):
    """epoch * 1000 + 0..n-1, each DataLoader worker reading every num_workers-th (`split`) or all of them."""

    def __init__(self, n: int = SAMPLES, split: bool = True) -> None:
        self.n, self.split, self.epoch = n, split, 0
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None and self.split else (0, 1)
        return iter(range(self.epoch * 1000 + first, self.epoch * 1000 + self.n, step))


def loaders(
    dataset: Any, world: int, workers: int = 0, shuffle: bool = True, accum: int = 1, drop_last: bool = False
) -> list[EpochStreamLoader]:
    """A loader per rank of `world`, GLOBAL // world samples a rank, as Engine.dataloader makes them."""
    made = [
        make_loader(
            dataset,
            num_workers=workers,
            seed=SEED,
            batch_size=GLOBAL // world,
            shuffle=shuffle,
            drop_last=drop_last,
            collate_fn=list,
            rank=rank,
            world_size=world,
            grad_accum_steps=accum,
            device=torch.device("cpu"),
        )
        for rank in range(world)
    ]
    assert all(isinstance(loader, EpochStreamLoader) for loader in made)
    return made  # type: ignore[return-value]


@dataclass
class Step:
    samples: list[Any]  # the global batch in stream order, padding left out
    parts: list[Batch]  # each rank's


def one_pass(ranks: list[EpochStreamLoader], stop: int | None = None) -> list[Step]:
    """A `for` over each rank's loader side by side (left after `stop` batches: a `break`). zip's strict checks that
    every rank runs the same number of steps."""
    steps = []
    for data in zip(*(itertools.islice(rank, stop) for rank in ranks), strict=True):
        parts = [rank.yielded[-1] for rank in ranks]
        placed = {}  # the real samples by their place in the stream
        for part, batch in zip(data, parts, strict=True):
            placed.update(zip(batch.indices[: batch.real], part[: batch.real], strict=True))
        steps.append(Step([placed[place] for place in sorted(placed)], parts))
    return steps


def samples(steps: list[Step]) -> list[list[Any]]:
    return [step.samples for step in steps]


def epochs(ranks: list[EpochStreamLoader], count: int) -> list[list[list[Any]]]:
    """`count` passes (`for batch in loader`, each an epoch): each one's global batches."""
    return [samples(one_pass(ranks)) for _ in range(count)]


def windowed(dataset: Any, workers: int = 0) -> IterableStream:
    return IterableStream(dataset, window=WINDOW, num_workers=workers)


def resume(stream: Any, one: list[list[list[Any]]], at: tuple[int, int], worlds: tuple[int, int], **kw: Any) -> None:
    """`worlds[0]` ranks train to global batch `at` = (epoch, batch) and break; `worlds[1]` ranks loaded with their
    state carry on with one process's batches (from the next epoch's start if `at` is an epoch's end)."""
    epoch, stop = at
    before = loaders(stream, worlds[0], **kw)
    assert [*epochs(before, epoch), samples(one_pass(before, stop))] == [*one[:epoch], one[epoch][:stop]]
    after = loaders(stream, worlds[1], **kw)
    for loader in after:
        loader.load_state_dict(before[-1].state_dict())
    rest = [one[epoch][stop:]] if stop < len(one[epoch]) else []  # at an epoch's end: the next epoch's start
    assert after[0].epoch == epoch + 1 - len(rest)
    assert epochs(after, len(rest) + len(one) - epoch - 1) == rest + one[epoch + 1 :]


def test_windows_cut_the_stream_in_order_from_any_window_and_set_the_epoch() -> None:
    numbers = Numbers()
    stream = windowed(numbers)
    assert list(stream.windows(0, 0)) == [list(range(a, min(a + 5, SAMPLES))) for a in range(0, SAMPLES, 5)]
    assert list(stream.windows(2, 3)) == [list(range(2015, 2020)), list(range(2020, 2023))]
    assert numbers.epochs == [0, 2]


@pytest.mark.parametrize("workers", [0, 2])
def test_any_world_size_makes_one_process_global_batches_and_resumes_at_another(workers: int) -> None:
    """Global batches of 6 from 1, 2 and 3 ranks are the same, epoch after epoch of 23 samples (each ends with a
    batch of 5); a position saved at 2 ranks carries on at 3 with the rest, each sample once. With 2 workers each
    reads every other sample, and the windows are the workers' in turn: another order than without workers, the same
    for every world size (checked over fewer epochs: each epoch starts the workers of every rank's loader anew)."""
    stream = windowed(Numbers(), workers)
    count, at = (3, (1, 2)) if workers == 0 else (2, (0, 2))
    one = epochs(loaders(stream, 1, workers), count)
    assert all([len(batch) for batch in epoch] == [6, 6, 6, 5] for epoch in one)
    if workers == 0:
        assert epochs(loaders(stream, 3, workers), count) == one
    resume(stream, one, at, (2, 3), workers=workers)
    for epoch, batches in enumerate(one):  # each epoch, each sample once
        assert sorted(s for batch in batches for s in batch) == list(range(1000 * epoch, 1000 * epoch + SAMPLES))
    first = one[0][0][:WINDOW]
    assert sorted(first) == (list(range(5)) if workers == 0 else [0, 2, 4, 6, 8])  # worker 0's first window
    assert first != sorted(first)  # shuffled within it


def test_an_unshuffled_stream_is_the_datasets_order_and_a_plain_iterable_streams_too() -> None:
    class Letters:  # iterable, no length, no torch: read again every epoch
        def __iter__(self) -> Iterator[str]:
            return iter("abcdefg")

    assert is_iterable_dataset(Letters()) and not is_iterable_dataset(list("abc"))
    stream = IterableStream(Letters(), window=3)
    assert epochs(loaders(stream, 2, shuffle=False), 2) == [[list("abcdef"), list("g")]] * 2


def mean_over_real_samples(steps: list[Step], world: int) -> list[int]:
    """Checks that each optimizer step's gradient is the mean over its real samples: every real sample's loss counts
    1 / (the window's samples) (DDP averages the ranks' weighted means), padding 0. Returns the windows' sizes."""
    windows, size, coefficients = [], 0, []
    for step in steps:
        assert len({part.ends_window for part in step.parts}) == 1  # every rank ends the window together
        size += len(step.samples)
        for part in step.parts:
            assert part.global_size == len(step.samples)
            coefficients += [part.weight / part.real / world] * part.real if part.real else [part.weight]
        if step.parts[0].ends_window:
            assert [c * size for c in coefficients if c] == pytest.approx([1.0] * size)
            windows, size, coefficients = [*windows, size], 0, []
    assert size == 0  # the epoch's last batch ends its window
    return windows


@pytest.mark.parametrize(("n", "accum"), [(21, 1), (21, 2), (19, 2)])
def test_each_for_is_one_epoch_ending_with_a_short_batch_split_and_weighted_alike_at_any_world_size(
    n: int, accum: int
) -> None:
    """A `for` over the loader yields its epoch's batches and stops: over 21 samples, global batches of 6 end with one
    of 3, split 2:1 at 2 ranks and 1:1:1 at 3; over 19, with one of 1, which 2 of 3 ranks pad. Two `for` loops are
    the two epochs, each sample once, the same global batches and windows at 1, 2 and 3 ranks, each optimizer step
    the mean over its real samples (windows of 2 batches: 12 then 9 or 7 samples)."""
    ones = None
    for world in (1, 2, 3):
        ranks = loaders(windowed(Numbers(n)), world, accum=accum)
        passes = [one_pass(ranks) for _ in range(2)]
        assert [rank.epoch for rank in ranks] == [2] * world and ranks[0].samples_seen == 2 * n
        for epoch, steps in enumerate(passes):
            assert sorted(s for batch in samples(steps) for s in batch) == list(range(1000 * epoch, 1000 * epoch + n))
            assert [len(batch) for batch in samples(steps)] == [6, 6, 6, n - 18]
            short = n - 18 if accum == 1 else 6 + n - 18
            assert mean_over_real_samples(steps, world) == ([6] * 3 + [short] if accum == 1 else [12, short])
        if world == 3:
            assert [part.real for part in passes[0][-1].parts] == ([1, 1, 1] if n == 21 else [1, 0, 0])
        ones = ones or passes
        assert [samples(steps) for steps in passes] == [samples(steps) for steps in ones]


def test_a_break_loses_nothing_and_a_resume_at_another_world_size_continues_mid_epoch_or_at_its_end() -> None:
    """A `for` left midway (mid-window too) and begun again carries on with the same batches and weights; after an
    epoch's last batch, with the next epoch. A state saved mid-epoch, mid-window or at the epoch's very end (the pass
    not yet over) resumes at another world size with one process's batches, the end's with the next epoch."""
    stream = windowed(Numbers(21))
    one = epochs(loaders(stream, 1, accum=2), 3)
    ranks, fresh = loaders(stream, 2, accum=2), loaders(stream, 2, accum=2)
    whole = [step for _ in range(3) for step in one_pass(fresh)]
    # Epoch 0 left after 1 batch (mid-window) and after its last; epoch 1 whole; epoch 2 left after 1 batch.
    steps = one_pass(ranks, 1) + one_pass(ranks, 3) + one_pass(ranks) + one_pass(ranks, 1) + one_pass(ranks)
    assert [step.parts for step in steps] == [step.parts for step in whole]
    assert samples(steps) == [batch for epoch in one for batch in epoch]
    for at, worlds in [((0, 1), (2, 3)), ((0, 2), (3, 1)), ((0, 4), (2, 3)), ((1, 4), (3, 2))]:
        resume(stream, one, at, worlds, accum=2)


def test_drop_last_drops_an_epochs_short_last_batch() -> None:
    ranks = loaders(windowed(Numbers(21)), 3, drop_last=True)
    assert [[len(batch) for batch in epoch] for epoch in epochs(ranks, 2)] == [[6, 6, 6]] * 2
    assert ranks[0].samples_seen == 36 and ranks[0].epoch == 2
    with pytest.raises(UsageError, match="drop_last leaves no batch in epoch 0"):
        one_pass(loaders(windowed(Numbers(5)), 2, drop_last=True))


def test_map_style_datasets_keep_the_in_memory_loader_and_a_windowed_stream_its_endless_one(hf_data: Any) -> None:
    import datasets

    settings = dict(seed=0, batch_size=2, shuffle=False, rank=0, world_size=1, grad_accum_steps=1)
    for dataset in (TensorDataset(torch.arange(4)), list(range(4)), datasets.Dataset.from_dict({"a": [1, 2]})):
        assert isinstance(
            make_loader(dataset, num_workers=0, device=torch.device("cpu"), **settings), DistributedLoader
        )

    class Windows:  # a WindowedStream of its own, as the recipes' --data-streaming reads: epochs of 3 samples
        def windows(self, epoch: int, first: int) -> Iterator[list[int]]:
            return iter([[10 * epoch, 10 * epoch + 1, 10 * epoch + 2]][first:])

    endless = make_loader(Windows(), num_workers=0, device=torch.device("cpu"), **settings)
    assert type(endless) is StreamLoader
    assert [batch.tolist() for batch in itertools.islice(endless, 4)] == [[0, 1], [2, 10], [11, 12], [20, 21]]


def test_workers_that_each_read_the_whole_stream_are_refused() -> None:
    with pytest.raises(UsageError, match="gives each worker the whole stream"):
        next(iter(loaders(windowed(Numbers(split=False), 2), 1, workers=2)[0]))


def test_refusals() -> None:
    with pytest.raises(UsageError, match="can be read only once"):
        IterableStream(iter(range(4)))
    with pytest.raises(UsageError, match="at least 1 sample"):
        IterableStream(Numbers(), window=0)
    with pytest.raises(UsageError, match="num_workers must be 0 or more"):
        loaders(Numbers(), 1, workers=-1)
    with pytest.raises(UsageError, match="length is not known"):
        len(loaders(Numbers(), 1)[0])
    saved = loaders(windowed(Numbers()), 1)[0].state_dict()
    assert saved["stream_window"] == WINDOW and saved["stream_workers"] == 0
    for other in (IterableStream(Numbers(), window=4), windowed(Numbers(), 2)):
        with pytest.raises(UsageError, match="resume with the window and num_workers of the run that saved it"):
            loaders(other, 1)[0].load_state_dict(saved)


def json_lines(folder: Path, files: int = 2, per_file: int = 12) -> list[str]:
    """`files` JSON lines files of records {"id", "x"}: ids 100 * file + line."""
    paths = []
    for f in range(files):
        path = folder / f"part{f}.jsonl"
        path.write_text("".join(json.dumps({"id": 100 * f + i, "x": [i / 8, f / 4]}) + "\n" for i in range(per_file)))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Hugging Face streaming dataset over two JSON lines files of 12 records (load_dataset takes ~1 s: once)."""
    import datasets

    datasets.disable_progress_bars()
    files = json_lines(tmp_path_factory.mktemp("json"))
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


ALL_IDS = [*range(12), *range(100, 112)]


def ids(batches: list[list[dict]]) -> list[list[int]]:
    return [[record["id"] for record in batch] for batch in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hugging_face_streaming_dataset_streams_and_resumes_exactly(hf_data: Any, workers: int) -> None:
    """Global batches of 6 over 24 records: 1 and 2 ranks make the same ones over 4 epochs (Hugging Face reorders
    the files by the epoch: epoch 3 starts with the second), and a resume at 3 ranks from a position in epoch 0
    (which `skip` reaches, without workers) and in epoch 3 (read up to) carries on with the same batches. With
    workers, over 2 epochs (each starts every loader's workers anew) and from a position in epoch 1."""
    assert is_iterable_dataset(hf_data)
    stream = IterableStream(hf_data, window=WINDOW, num_workers=workers)
    count, stops = (4, ((0, 2), (3, 1))) if workers == 0 else (2, ((1, 1),))
    one = epochs(loaders(stream, 1, workers), count)
    assert all(sorted(record["id"] for batch in epoch for record in batch) == ALL_IDS for epoch in one)
    assert all(len(epoch) == 4 for epoch in one)  # 24 records: 4 full batches, and the epoch's end found after them
    assert any(sample >= 100 for sample in ids(one[0])[0]) == (workers > 0)  # with workers the files take turns
    assert workers or set(range(100, 105)) <= set(ids(one[3])[0])  # epoch 3 starts with the second file
    for at in stops:
        with mock.patch.object(type(hf_data), "skip", autospec=True, side_effect=type(hf_data).skip) as skip:
            resume(stream, one, at, (2, 3), workers=workers)
        assert [call.args[1] for call in skip.call_args_list] == ([10] * 3 if at == (0, 2) else [])


def test_a_split_hugging_face_dataset_is_refused(hf_data: Any) -> None:
    from datasets.distributed import split_dataset_by_node

    part = split_dataset_by_node(hf_data, rank=0, world_size=2)
    with pytest.raises(UsageError, match="the dataset before the split"):
        loaders(part, 1)
