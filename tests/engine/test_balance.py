"""batch_shares auto's arithmetic: the split that measured speeds and memory call for, and when it is kept. (Its
run in two processes, a rank slowed: tests/engine/test_engine.py.)"""

from __future__ import annotations

from multigpu.engine.balance import next_split

UNLIMITED = [float("inf")] * 2


def test_a_slower_rank_gets_a_part_in_proportion_to_its_speed() -> None:
    assert next_split([8, 8], [1.0, 2.0], UNLIMITED) == [11, 5]  # 16 x 2/3 = 10.7: rank 0 takes 11
    assert next_split([11, 5], [2.0, 1.0], UNLIMITED) == [5, 11]  # it slowed in turn: back the other way
    # 8 x 4/13 = 2.46 for each fast rank: the spare sample goes to the lowest.
    assert next_split([2, 2, 2, 2], [1.0, 1.0, 1.0, 4.0], [float("inf")] * 4) == [3, 2, 2, 1]


def test_speeds_within_the_hysteresis_keep_the_split() -> None:
    assert next_split([8, 8], [1.0, 1.0], UNLIMITED) is None
    assert next_split([8, 8], [1.0, 1.04], UNLIMITED) is None  # [8, 8] -> [9, 7] would gain under 5%
    assert next_split([8, 8], [1.0, 1.2], UNLIMITED) == [9, 7]


def test_no_part_is_larger_than_its_rank_memory_holds() -> None:
    assert next_split([8, 8], [1.0, 3.0], [10, float("inf")]) == [10, 6]  # 12 by speed, 10 by memory
    # A part that no longer fits (another job took the GPU's memory) moves even where the step gets slower.
    assert next_split([12, 4], [1.0, 3.0], [10, float("inf")]) == [10, 6]
    assert next_split([8, 8], [1.0, 3.0], [6, 6]) is None  # 16 samples do not fit in 12: the split stays
