"""batch_shares auto's arithmetic: the split that measured steps and memory call for, when it is kept, and the
search over a run's checks against simulated ranks (a fixed cost per step plus a cost per sample, noisy). (Its run
in two processes, a rank slowed: tests/engine/test_engine.py.)"""

from __future__ import annotations

import math
import random

import pytest

from multigpu.engine.balance import CHECK_EVERY, WARMUP_STEPS, SplitSearch, StepTimes, next_split
from multigpu.planner.gpus import quickest_split

UNLIMITED = [float("inf")] * 2
NONE = [0.0, 0.0]  # no fixed work per step: the time in proportion to the part


def test_a_slower_rank_gets_a_part_in_proportion_to_its_speed() -> None:
    assert next_split([8, 8], NONE, [1.0, 2.0], UNLIMITED) == [11, 5]  # 16 x 2/3 = 10.7: rank 0 takes 11
    assert next_split([11, 5], NONE, [2.0, 1.0], UNLIMITED) == [5, 11]  # it slowed in turn: back the other way
    # 8 x 4/13 = 2.46 for each fast rank: the spare sample goes to the lowest.
    assert next_split([2, 2, 2, 2], [0.0] * 4, [1.0, 1.0, 1.0, 4.0], [float("inf")] * 4) == [3, 2, 2, 1]


def test_a_slower_rank_fixed_work_per_step_moves_more_of_the_batch_off_it() -> None:
    # The sensor trainer's shape: rank 1 runs at half speed, a fifth of each step fixed whatever the part.
    fixed, per_sample = [0.006, 0.012], [0.00052, 0.00104]
    assert next_split([32, 32], NONE, per_sample, UNLIMITED) == [43, 21]  # by speed alone
    assert next_split([32, 32], fixed, per_sample, UNLIMITED) == [47, 17]  # steps of 30.4 ms and 29.7 ms


def test_speeds_within_the_margin_keep_the_split() -> None:
    assert next_split([8, 8], NONE, [1.0, 1.0], UNLIMITED) is None
    assert next_split([8, 8], NONE, [1.0, 1.04], UNLIMITED) is None  # [8, 8] -> [9, 7] would gain under 5%
    assert next_split([8, 8], NONE, [1.0, 1.2], UNLIMITED) == [9, 7]
    assert next_split([8, 8], NONE, [1.0, 1.2], UNLIMITED, margin=0.1) is None  # 6.7% shorter: not 10%


def test_no_part_is_larger_than_its_rank_memory_holds() -> None:
    assert next_split([8, 8], NONE, [1.0, 3.0], [10, float("inf")]) == [10, 6]  # 12 by speed, 10 by memory
    # A part that no longer fits (another job took the GPU's memory) moves even where the step gets slower.
    assert next_split([12, 4], NONE, [1.0, 3.0], [10, float("inf")]) == [10, 6]
    assert next_split([8, 8], NONE, [1.0, 3.0], [6, 6]) is None  # 16 samples do not fit in 12: the split stays


def test_a_rank_steps_at_two_parts_give_its_fixed_and_per_sample_seconds() -> None:
    times = StepTimes()
    times.add([(32.0, 0.04)] * 4)
    assert times.line() == pytest.approx((0.0, 0.00125))  # one part: in proportion to it
    times.add([(16.0, 0.024)] * 4)
    assert times.line() == pytest.approx((0.008, 0.001))  # noiseless: the line through both
    times.add([(8.0, 0.004)] * 4)  # a slope steeper than the whole step over the part is kept to it: no negative work
    assert times.line()[0] == pytest.approx(0.0)


def run(
    fixed: list[float],
    per_sample: list[float],
    noise: float,
    seed: int,
    steps: int = 176,
    slower: tuple[int, int, float] | None = None,
    drift: float = 0.0,
) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """A run of `steps` under batch_shares auto, as the Balancer drives it, each rank's step `fixed` plus its part
    times `per_sample` seconds, times a random factor (lognormal, `noise` its spread) and a load that drifts (its
    log a random walk pulled back 5% a step, `drift` its spread); `slower` = (step, rank, factor) changes a rank's
    speed from that step. A split applies from the step after next (the loader's prefetched batch). Each change
    (its step and split), and the split at the end."""
    rng, fixed, per_sample = random.Random(seed), list(fixed), list(per_sample)
    parts, search, changes = [64 // len(fixed)] * len(fixed), SplitSearch(len(fixed)), []
    windows: list[list[tuple[float, float]]] = [[] for _ in fixed]
    load = [0.0] * len(fixed)
    for step in range(1, steps + 1):
        if slower is not None and step == slower[0]:
            fixed[slower[1]] *= slower[2]
            per_sample[slower[1]] *= slower[2]
        if changes and changes[-1][0] + 2 == step:
            parts = changes[-1][1]
        load = [0.95 * log + drift * math.sqrt(1 - 0.95**2) * rng.gauss(0, 1) for log in load]
        for rank, window in enumerate(windows):
            seconds = (fixed[rank] + per_sample[rank] * parts[rank]) * math.exp(rng.gauss(0, noise) + load[rank])
            window.append((float(parts[rank]), seconds))
        if step <= WARMUP_STEPS:
            windows = [[] for _ in fixed]
        elif not (step - WARMUP_STEPS) % CHECK_EVERY:
            split = search.check(changes[-1][1] if changes else parts, windows, [math.inf] * len(fixed))
            changes += [(step, split)] if split is not None else []
            windows = [[] for _ in fixed]
    return changes, changes[-1][1] if changes else parts


SENSOR = ([0.006, 0.012], [0.00052, 0.00104])  # rank 1 at half speed; its best split 47:17 (by speed alone 43:21)


@pytest.mark.parametrize(("noise", "within"), [(0.05, 2), (0.2, 3)])
def test_auto_ends_near_the_quickest_split_and_settles(noise: float, within: int) -> None:
    best = quickest_split([64, 64], *SENSOR, 64)
    for seed in range(10):
        changes, final = run(*SENSOR, noise, seed)
        assert abs(final[0] - best[0]) <= within and 1 <= len(changes) <= 3, (seed, changes)


def test_a_load_that_drifts_moves_the_split_a_few_times_not_at_every_check() -> None:
    # Steps in a row alike (another job's load coming and going): their spread understates their mean's error.
    counts = [len(run(*SENSOR, 0.1, seed, drift=0.15)[0]) for seed in range(10)]
    assert max(counts) <= 5 and sum(counts) <= 30, counts


def test_equal_ranks_keep_the_even_split_through_noise() -> None:
    for seed in range(10):
        assert run([0.006] * 2, [0.0005] * 2, 0.2, seed, steps=400) == ([], [32, 32])


def test_auto_follows_a_rank_whose_speed_changes_later() -> None:
    for factor in (0.5, 2.0):  # rank 1 becomes as fast as rank 0, or four times slower
        fixed, per_sample = [SENSOR[0][0], SENSOR[0][1] * factor], [SENSOR[1][0], SENSOR[1][1] * factor]
        best = quickest_split([64, 64], fixed, per_sample, 64)
        for seed in range(10):
            changes, final = run(*SENSOR, 0.1, seed, steps=300, slower=(100, 1, factor))
            after = [step for step, _ in changes if step >= 100]
            assert abs(final[0] - best[0]) <= 3 and 1 <= len(after) <= 3, (factor, seed, changes)


def test_four_ranks_one_slow_end_near_the_quickest_split() -> None:
    fixed, per_sample = [0.006] * 3 + [0.009], [0.0005] * 3 + [0.001]
    best = quickest_split([64] * 4, fixed, per_sample, 64)
    for seed in range(5):
        changes, final = run(fixed, per_sample, 0.1, seed)
        assert max(abs(a - b) for a, b in zip(final, best, strict=True)) <= 2 and len(changes) <= 3, (seed, changes)
