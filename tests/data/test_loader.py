"""The loader's contract, checked without processes: each rank's loader is built with an explicit rank."""

from __future__ import annotations

import itertools
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import multigpu as mg
from multigpu.config.layout import split_by_shares
from multigpu.core.errors import UsageError
from multigpu.data.loader import DistributedLoader, EpochPlan
from multigpu.data.random_windows import RandomWindows
from multigpu.data.shuffle import Permutation
from multigpu.data.stream import WindowedStream


def loaders(samples: int, world: int, batch: int, accum: int = 1, **kwargs) -> list[DistributedLoader]:
    data = kwargs["data"] if "data" in kwargs else TensorDataset(torch.arange(samples))
    return [
        DistributedLoader(
            data,
            batch_size=batch,
            shuffle=kwargs.get("shuffle", True),
            drop_last=kwargs.get("drop_last", False),
            num_workers=kwargs.get("num_workers", 0),
            collate_fn=None,
            rank=rank,
            world_size=world,
            grad_accum_steps=accum,
            seed=3,
            device=torch.device("cpu"),
            shares=kwargs.get("shares"),
        )
        for rank in range(world)
    ]


def take(loader_list: list[DistributedLoader], steps: int | None = None) -> list[int]:
    """Real samples the ranks' loaders yield together, `steps` batches each (None: to the end of the epoch)."""
    seen = []
    iterators = [iter(loader) for loader in loader_list]
    for _ in itertools.islice(itertools.count(), steps):
        try:
            batches = [next(it) for it in iterators]
        except StopIteration:
            break
        for loader, (values,) in zip(loader_list, batches, strict=True):
            seen += values[: loader.yielded[-1].real].tolist()
    return seen


SHARED = [(20, 3, 2, 1, (3, 1, 1)), (42, 2, 2, 4, (1, 3)), (13, 2, 3, 3, (2.5, 1)), (9, 4, 1, 1, (1, 1, 1, 5))]


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accum", "shares"),
    [(20, 3, 2, 1, None), (42, 2, 2, 4, None), (5, 8, 1, 1, None), (64, 4, 4, 2, None), *SHARED],
)
def test_epoch_covers_every_sample_once_with_equal_batch_counts(samples, world, batch, accum, shares) -> None:
    group = loaders(samples, world, batch, accum, shares=shares)
    assert len({len(loader) for loader in group}) == 1
    assert sorted(take(group)) == list(range(samples))


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accum", "shares"),
    [(20, 3, 2, 1, None), (42, 2, 2, 4, None), (5, 8, 1, 1, None), (13, 2, 3, 3, None), *SHARED],
)
def test_weights_average_each_window_over_its_real_samples(samples, world, batch, accum, shares) -> None:
    settings = {"world_size": world, "batch_size": batch, "grad_accum_steps": accum, "drop_last": False}
    plans = [EpochPlan(samples, 0, rank=r, **settings, order=None, shares=shares) for r in range(world)]
    window_weight = 0.0
    for step in zip(*plans, strict=True):
        window_weight += sum(batch.weight for batch in step)
        assert all(batch.weight == 0 for batch in step if batch.real == 0)  # padding never counts
        if step[0].ends_window:
            # DDP divides the summed gradients by the world size; the weights must undo exactly that.
            assert window_weight == pytest.approx(world)
            window_weight = 0.0


def test_drop_last_drops_only_the_short_global_batch() -> None:
    group = loaders(20, 3, 2, drop_last=True)
    seen = take(group)
    assert len(seen) == 18 and len(set(seen)) == 18


def test_reshuffles_every_epoch_and_order_does_not_depend_on_world_size() -> None:
    one = loaders(24, 1, 4)
    first, second = take(one), take(one)
    assert first != second and sorted(first) == sorted(second)
    two = loaders(24, 2, 2)
    two_first = take(two)
    # The same global batches of 4, whatever the split: compare batch by batch as sets.
    assert [set(first[i : i + 4]) for i in range(0, 24, 4)] == [set(two_first[i : i + 4]) for i in range(0, 24, 4)]


@pytest.mark.parametrize(("world_before", "world_after"), [(2, 1), (2, 3), (3, 2), (1, 4)])
def test_resume_at_another_world_size_sees_each_sample_exactly_once(world_before: int, world_after: int) -> None:
    before = loaders(50, world_before, 3)
    seen = take(before, steps=3)
    state = before[0].state_dict()
    after = loaders(50, world_after, 3)
    for loader in after:
        loader.load_state_dict(state)
    seen += take(after)
    assert Counter(seen) == Counter(range(50))
    # ...and the next epoch starts afresh on the new world size.
    assert sorted(take(after)) == list(range(50))


def test_resume_refuses_a_different_order() -> None:
    state = loaders(10, 1, 2)[0].state_dict()
    (other,) = loaders(10, 1, 2, shuffle=False)
    with pytest.raises(UsageError, match="shuffle or seed"):
        other.load_state_dict(state)


def test_workers_load_the_same_batches() -> None:
    data = TensorDataset(torch.arange(30))
    kwargs = dict(
        batch_size=4,
        shuffle=True,
        drop_last=False,
        collate_fn=None,
        rank=1,
        world_size=2,
        grad_accum_steps=1,
        seed=0,
        device=torch.device("cpu"),
    )
    inline = [batch[0].tolist() for batch in DistributedLoader(data, num_workers=0, **kwargs)]
    workers = [batch[0].tolist() for batch in DistributedLoader(data, num_workers=2, **kwargs)]
    assert inline == workers


def test_rejects_a_zero_batch_size() -> None:
    with pytest.raises(UsageError, match="batch_size must be at least 1"):
        loaders(10, 1, 0)


@pytest.mark.parametrize("samples", [1, 2, 3, 4, 7, 16, 31, 64, 97, 127, 128, 1000])
def test_each_epoch_order_is_a_permutation(samples: int) -> None:
    orders = [Permutation(samples, seed, epoch)(np.arange(samples)) for seed, epoch in [(3, 0), (3, 1), (4, 0)]]
    for order in orders:
        assert sorted(order.tolist()) == list(range(samples))
    if samples > 3:  # shuffled at all, and differently for another epoch or another seed
        assert (orders[0] != np.arange(samples)).any()
        assert (orders[0] != orders[1]).any() and (orders[0] != orders[2]).any()


def test_a_batch_read_from_the_cached_chunk_is_what_the_network_gives() -> None:
    """Batches are read from a chunk of 4,096 positions computed at once; the whole order (wider than a chunk) is
    computed directly: the two must agree, across chunk boundaries and at the epoch's end."""
    samples = 10_000
    whole = Permutation(samples, 5, 2)(np.arange(samples))
    assert sorted(whole.tolist()) == list(range(samples))
    chunked = Permutation(samples, 5, 2)
    for first in [0, 12, 4090, 4096, 9990, 3, 8190, 0]:
        positions = np.arange(first, min(first + 12, samples), 2)
        assert chunked(positions).tolist() == whole[positions].tolist(), first


def global_batches(samples: int, world: int, batch: int, epochs: int = 2, **kwargs) -> list[list[int]]:
    """Each global batch as one process sees it: rank r's j-th real sample is the batch's (j*world + r)-th."""
    group = loaders(samples, world, batch, **kwargs)
    out = []
    for _ in range(epochs):
        for step in zip(*group, strict=True):
            merged: dict[int, int] = {}
            for rank, (loader, (values,)) in enumerate(zip(group, step, strict=True)):
                for j, value in enumerate(values[: loader.yielded[-1].real].tolist()):
                    merged[j * world + rank] = value
            out.append([merged[i] for i in sorted(merged)])
    return out


@pytest.mark.parametrize(("samples", "batch"), [(23, 2), (7, 1), (2, 1)])
def test_every_world_size_sees_the_one_process_global_batches(samples: int, batch: int) -> None:
    one = global_batches(samples, 1, batch * 6)
    for world in (2, 3):
        assert global_batches(samples, world, batch * 6 // world) == one


def test_a_state_from_the_earlier_order_is_refused_in_one_sentence() -> None:
    (loader,) = loaders(10, 1, 2)
    old = {key: value for key, value in loader.state_dict().items() if key != "order"}
    with pytest.raises(UsageError, match=r"^[^.]*earlier multigpu version[^.]*start anew\.$"):
        loader.load_state_dict(old)
    (unshuffled,) = loaders(10, 1, 2, shuffle=False)
    unshuffled.load_state_dict({**old, "shuffle": 0, "position": 4})  # the dataset's own order never changed
    assert take([unshuffled]) == list(range(4, 10))


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accum", "drop_last"),
    [(20, 3, 2, 1, False), (42, 2, 2, 4, False), (5, 8, 1, 1, False), (43, 2, 3, 2, True), (12, 2, 3, 3, True)],
)
def test_lengths_and_step_samples_are_what_a_pass_counts(samples, world, batch, accum, drop_last) -> None:
    group = loaders(samples, world, batch, accum, drop_last=drop_last)
    per_step, batches = [0], 0
    for _ in zip(*group, strict=True):
        batches += 1
        per_step[-1] += group[0].yielded[-1].global_size
        if group[0].yielded[-1].ends_window:
            per_step.append(0)
    per_step.pop()
    assert len(group[0]) == batches
    for steps in range(2 * len(per_step) + 2):
        epochs, rest = divmod(steps, len(per_step))
        assert group[0].samples_in_steps(steps) == epochs * sum(per_step) + sum(per_step[:rest])
    fresh = loaders(samples, world, batch, accum, drop_last=drop_last)[0]
    for expected in per_step:
        assert fresh.next_step_samples() == expected
        fresh.load_state_dict({**fresh.state_dict(), "position": fresh.position + expected})


class Indices(Dataset):
    """A billion samples that are their own index: nothing per sample exists until a batch asks for it."""

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> int:
        return index


def test_a_billion_samples_start_without_planning_the_epoch() -> None:
    group = loaders(10**9, 2, 4, accum=2, data=Indices())
    tracemalloc.start()
    try:
        firsts = [next(iter(loader)) for loader in group]
        lengths = [len(loader) for loader in group]
        budget = group[0].samples_in_steps(10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**22  # a planned epoch would hold 10**9 Python ints (tens of GB)
    assert lengths == [125_000_000] * 2 and budget == 16 * 10**6
    seen = torch.cat(firsts).tolist()
    assert len(set(seen)) == 8 and all(0 <= index < 10**9 for index in seen)
    assert group[0].state_dict()["position"] == 8 and len(group[0].yielded) == 1


TOKENS = torch.arange(1000) * 7 % 1009  # distinct tokens: a window's place can be read back from its first token
PLACE = {int(token): place for place, token in enumerate(TOKENS)}


def test_random_windows_are_in_range_and_shifted_by_one() -> None:
    windows = RandomWindows(TOKENS.numpy().astype(np.uint16), block_size=16, samples=200, seed=5)
    starts = []
    for i in range(len(windows)):
        x, y = windows[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
        start = windows.start(i)
        assert 0 <= start < 1000 - 16
        assert torch.equal(x, TOKENS[start : start + 16]) and torch.equal(y, TOKENS[start + 1 : start + 17])
        starts.append(start)
    assert len(set(starts)) > 150  # drawn with replacement, but spread over the whole array
    assert [RandomWindows(TOKENS, 16, 200, seed=5).start(i) for i in range(200)] == starts
    assert len(RandomWindows(TOKENS, 16)) == 1000 // 16


def test_random_windows_read_a_memmap_through_the_engine(tmp_path) -> None:
    path = tmp_path / "train.bin"
    TOKENS.numpy().astype(np.uint16).tofile(path)
    windows = RandomWindows(np.memmap(path, dtype=np.uint16, mode="r"), block_size=8, samples=40)
    engine = mg.Engine(strategy="single")
    assert not isinstance(windows, WindowedStream)
    loader = engine.dataloader(windows, batch_size=4, shuffle=False)
    x, y = next(iter(loader))
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[0], TOKENS[windows.start(0) : windows.start(0) + 8])


def test_random_windows_are_the_same_at_every_world_size_and_resume_exactly() -> None:
    windows = RandomWindows(TOKENS, block_size=8, samples=30, seed=1)
    starts = [windows.start(i) for i in range(30)]
    assert take_windows(loaders(30, 1, 6, data=windows, shuffle=False), None) == starts
    before = loaders(30, 2, 3, data=windows, shuffle=False)
    assert take_windows(before, None) == starts
    first = take_windows(before, 2)  # the next epoch, left after 2 global batches
    after = loaders(30, 3, 2, data=windows, shuffle=False)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    assert first + take_windows(after, None) == starts  # every epoch reads the same windows


def take_windows(group: list[DistributedLoader], steps: int | None) -> list[int]:
    """The start of each window the ranks read together, in global order, `steps` batches each."""
    starts = []
    for step in itertools.islice(zip(*[iter(loader) for loader in group], strict=True), steps):
        by_place = {j * len(group) + rank: x[j] for rank, (x, _) in enumerate(step) for j in range(len(x))}
        starts += [PLACE[int(by_place[i][0])] for i in sorted(by_place)]
    return starts


@pytest.mark.parametrize(("samples", "world", "batch", "accum", "shares"), SHARED)
def test_shares_split_the_one_process_global_batches_by_weight_and_resume_anywhere(
    samples, world, batch, accum, shares
) -> None:
    group = loaders(samples, world, batch, accum, shares=shares)
    one = take(loaders(samples, 1, batch * world, accum))
    seen = 0
    for step in zip(*group, strict=True):
        batches = [loader.yielded[-1] for loader in group]
        size = batches[0].global_size
        parts = [batch.real for batch in batches]
        if size >= world:
            assert parts == split_by_shares(size, shares)  # each rank its share, every rank at least one
        values = [v for loader, (x,) in zip(group, step, strict=True) for v in x[: loader.yielded[-1].real].tolist()]
        assert sorted(values) == sorted(one[seen : seen + size])  # the very global batch one process trains on
        seen += size
    # Saved under shares, resumed evenly or at another world size: each sample exactly once.
    for world_after, shares_after in [(world, None), (world + 1, None), (1, None), (2, (1, 4))]:
        before = loaders(samples, world, batch, accum, shares=shares)
        seen_before = take(before, steps=2)
        after = loaders(samples, world_after, batch, accum, shares=shares_after)
        for loader in after:
            loader.load_state_dict(before[0].state_dict())
        assert Counter(seen_before + take(after)) == Counter(range(samples))


@pytest.mark.parametrize("workers", [0, 1])
def test_shares_changed_during_a_pass_split_the_batches_not_yet_planned(workers: int) -> None:
    """batch_shares auto's change after the third batch: with a worker, the DataLoader has planned two batches
    more (prefetch_factor 2), on every rank alike; the global batches stay one process's, and each rank's
    yielded batches are recomputed as they were read."""
    group = loaders(56, 2, 4, shuffle=True, num_workers=workers)
    one = take(loaders(56, 1, 8))
    iterators = [iter(loader) for loader in group]
    parts, values = [], []
    for step in range(7):
        batches = [next(it)[0] for it in iterators]
        parts.append([len(batch) for batch in batches])
        values += [v for batch in batches for v in batch.tolist()]
        if step == 2:
            for loader in group:
                loader.set_shares((3.0, 1.0))
    assert parts == [[4, 4]] * (3 + 2 * workers) + [[6, 2]] * (4 - 2 * workers)
    assert sorted(values) == sorted(one) and len(set(values)) == 56
    for loader in group:
        assert [loader.yielded[k].real for k in range(7)] == [part[loader.rank] for part in parts]


def test_split_by_shares_adds_up_gives_each_rank_one_and_follows_the_weights() -> None:
    assert split_by_shares(8, (3, 1)) == [6, 2]
    assert split_by_shares(8, (1, 3)) == [2, 6]
    assert split_by_shares(4, (100, 1, 1, 1)) == [1, 1, 1, 1]  # at least one each, whatever the weights
    assert split_by_shares(5, (1, 1)) == [3, 2]  # a tie goes to the lower rank
    assert split_by_shares(10, (0.1, 0.2, 0.3)) == [2, 3, 5]
    for samples, shares in itertools.product(range(3, 40), [(1, 1, 1), (5, 1, 2), (1e-3, 1, 1e3), (0.3, 0.3, 0.4)]):
        parts = split_by_shares(samples, shares)
        assert sum(parts) == samples and min(parts) >= 1
        exact = [samples * share / sum(shares) for share in shares]
        if min(exact) >= 1:  # no minimum forced on a rank: each part is its exact share, rounded up or down
            assert all(abs(part - want) < 1 for part, want in zip(parts, exact, strict=True))


def test_fault_tolerance_splits_each_window_among_the_ranks_alive_and_runs_a_window_again() -> None:
    """Loaders of 3 replica groups of 1 rank each: from the second window on, groups 0 and 2 alone (places 0 and 1
    of 2) read every sample of each global batch between them, with weights that still average over the whole
    batch; a window rewound is handed out again, the same samples; and a pass carries on from a healed position."""
    three = loaders(60, 3, 2, accum=2)
    alive = [three[0], three[2]]
    for place, loader in enumerate(alive):
        loader.before_window = lambda loader=loader, place=place: (
            loader.set_split((place, 2)) if loader.position > 0 else None
        )
    iterators = [iter(loader) for loader in alive]
    first = [next(it) for it in iterators for _ in range(2)]  # a window of 2 batches, as 3 ranks (rank 1 lost)
    assert sum(len(values) for (values,) in first) == 8  # 2 of the 3 ranks' batches of 2, twice
    window = [[next(it) for _ in range(2)] for it in iterators]  # split among the 2 alive: 3 samples each
    samples = sorted(int(v) for batches in window for (values,) in batches for v in values)
    assert len(samples) == len(set(samples)) == 12  # the whole global batch of 3 x 2, twice, between the two
    # Each rank's batch weighs its 3 of the window's 12 samples, times the 2 ranks its gradient is averaged over.
    assert [loader.yielded[k].weight for loader in alive for k in (2, 3)] == pytest.approx([3 * 2 / 12] * 4)
    for loader in alive:
        loader.rewind_window()
    again = sorted(int(v) for it in iterators for _ in range(2) for (values,) in [next(it)] for v in values)
    assert again == samples
    healed = loaders(60, 3, 2, accum=2)[1]
    healed.before_window = lambda: healed.load_state_dict(alive[0].state_dict()) if healed.position == 0 else None
    (values,) = next(iter(healed))
    assert healed.position == alive[0].position + 6 and int(values[0]) not in samples
