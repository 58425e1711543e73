"""The learning-rate schedule over samples: the same lr at the same position in the data, at any world size."""

from __future__ import annotations

import pytest
import torch

from multigpu.data.loader import DistributedLoader
from multigpu.engine.lr_schedule import SampleSchedule, warmup_cosine


def loader(world_size: int, batch_size: int = 4, grad_accum_steps: int = 1, samples: int = 10) -> DistributedLoader:
    return DistributedLoader(
        list(range(samples)),
        batch_size=batch_size,
        shuffle=True,
        drop_last=False,
        num_workers=0,
        collate_fn=None,
        rank=0,
        world_size=world_size,
        grad_accum_steps=grad_accum_steps,
        seed=0,
        device=torch.device("cpu"),
    )


def test_warmup_then_cosine_to_zero() -> None:
    assert [warmup_cosine(p, 4, 12) for p in (0, 2, 4, 8, 12, 20)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert warmup_cosine(3, 0, 6) == pytest.approx(0.5)  # no warm-up: the cosine starts at once


@pytest.mark.parametrize(("world_size", "updates"), [(1, [4, 8, 10, 14]), (2, [8, 10, 18, 20]), (3, [10, 20])])
def test_each_update_gets_the_lr_at_the_samples_trained_once_it_is_done(world_size: int, updates: list[int]) -> None:
    """10 samples, 4 per device: an update ends where its global batch (or the epoch) does, whatever the world
    size, and its lr is the factor there; so the lr at every sample is the same at any world size."""
    data = loader(world_size)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = SampleSchedule(optimizer, data, warmup_samples=5, total_samples=30)
    used = []
    for _ in range(2):
        for _batch in data:
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
    assert used[: len(updates)] == [0.1 * warmup_cosine(end, 5, 30) for end in updates]


def test_a_resume_mid_epoch_sets_the_lr_of_the_next_update() -> None:
    data = loader(2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = SampleSchedule(optimizer, data, warmup_samples=5, total_samples=30)
    # 18 samples in; 2 left this epoch
    data.load_state_dict({"epoch": 1, "position": 8, "seed": 0, "shuffle": 1, "order": 2})
    schedule.load_state_dict(schedule.state_dict())
    assert optimizer.param_groups[0]["lr"] == 0.1 * warmup_cosine(20, 5, 30) == schedule.get_last_lr()[0]


def test_a_resumed_schedule_keeps_the_plan_it_was_saved_with() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    saved = SampleSchedule(optimizer, loader(2), warmup_samples=5, total_samples=30).state_dict()
    data = loader(3)
    data.load_state_dict({"epoch": 0, "position": 8, "seed": 0, "shuffle": 1, "order": 2})
    resumed = SampleSchedule(optimizer, data, warmup_samples=99, total_samples=999)
    resumed.load_state_dict(saved)
    assert (resumed.warmup_samples, resumed.total_samples) == (5, 30)
    assert optimizer.param_groups[0]["lr"] == 0.1 * warmup_cosine(8 + 2, 5, 30)  # the epoch's last 2 samples
    assert not resumed.done
    data.load_state_dict({"epoch": 3, "position": 0, "seed": 0, "shuffle": 1, "order": 2})
    assert resumed.done


@pytest.mark.parametrize(
    ("world_size", "batch_size", "grad_accum_steps", "steps", "samples"),
    [
        (1, 4, 1, 3, 10),  # steps of 4, 4, 2 samples
        (1, 4, 1, 4, 14),  # into the second epoch
        (2, 2, 2, 1, 8),  # two global batches of 4 per step
        (2, 2, 2, 3, 18),  # 8 + 2, then 8
        (3, 4, 1, 0, 0),
    ],
)
def test_a_step_budget_becomes_the_samples_those_steps_train_on(
    world_size: int, batch_size: int, grad_accum_steps: int, steps: int, samples: int
) -> None:
    assert loader(world_size, batch_size, grad_accum_steps).samples_in_steps(steps) == samples


def test_an_update_fp16_skipped_leaves_the_lr_where_it_was_and_is_saved() -> None:
    """The schedule waits for skipped updates, as a step schedule does; the data still ends the run."""
    data = loader(2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = SampleSchedule(optimizer, data, warmup_samples=5, total_samples=20)
    data.load_state_dict({"epoch": 1, "position": 0, "seed": 0, "shuffle": 1, "order": 2})  # 10 samples handed out
    schedule.skip(4)  # of which one update's 4 were skipped
    optimizer.step()
    schedule.step()
    assert schedule.samples == 6 and schedule.get_last_lr()[0] == 0.1 * warmup_cosine(6 + 8, 5, 20)
    resumed = SampleSchedule(optimizer, data, warmup_samples=5, total_samples=20)
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.samples == 6 and optimizer.param_groups[0]["lr"] == schedule.get_last_lr()[0]
    data.load_state_dict({"epoch": 2, "position": 0, "seed": 0, "shuffle": 1, "order": 2})
    assert resumed.done  # all 20 planned samples handed out, skipped ones included
