"""The loader's contract, checked without processes: each rank's loader is built with an explicit rank."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import TensorDataset

from multigpu.core.data import DistributedLoader, plan_epoch
from multigpu.core.errors import UsageError


def loaders(samples: int, world: int, batch: int, accum: int = 1, **kwargs) -> list[DistributedLoader]:
    data = TensorDataset(torch.arange(samples))
    return [
        DistributedLoader(
            data,
            batch_size=batch,
            shuffle=kwargs.get("shuffle", True),
            drop_last=kwargs.get("drop_last", False),
            num_workers=0,
            collate_fn=None,
            rank=rank,
            world_size=world,
            grad_accum_steps=accum,
            seed=3,
            device=torch.device("cpu"),
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


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accum"), [(20, 3, 2, 1), (42, 2, 2, 4), (5, 8, 1, 1), (64, 4, 4, 2)]
)
def test_epoch_covers_every_sample_once_with_equal_batch_counts(samples, world, batch, accum) -> None:
    group = loaders(samples, world, batch, accum)
    assert len({len(loader) for loader in group}) == 1
    assert sorted(take(group)) == list(range(samples))


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accum"), [(20, 3, 2, 1), (42, 2, 2, 4), (5, 8, 1, 1), (13, 2, 3, 3)]
)
def test_weights_average_each_window_over_its_real_samples(samples, world, batch, accum) -> None:
    plans = [
        plan_epoch(
            samples,
            0,
            rank=r,
            world_size=world,
            batch_size=batch,
            grad_accum_steps=accum,
            drop_last=False,
            order=list(range(samples)),
        )
        for r in range(world)
    ]
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
