"""The pipeline's stage placement, stages per rank and micro-batch counts (config/pipeline.py): what strategy pp, the
CLI and the planner read before anything is built."""

from __future__ import annotations

import pytest

from multigpu.config.pipeline import (
    check_microbatches,
    check_schedule,
    microbatch_count,
    rank_stages,
    stage_layers,
    stage_owners,
)
from multigpu.core.errors import UsageError


def test_a_v_puts_the_first_and_last_stage_on_rank_0_and_the_middle_two_on_the_last_rank() -> None:
    assert stage_owners("zbv", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages("dualpipev", 4, 2, 0) == [0, 7] and rank_stages("zbv", 4, 2, 3) == [3, 4]
    # Looped schedules: rank r holds r, r + pp, ...
    assert stage_owners("interleaved-zb", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert rank_stages("1f1b", 4, 1, 2) == [2]


def test_the_v_schedules_set_two_stages_per_rank_and_the_looped_ones_take_what_is_given() -> None:
    assert check_schedule("zbv", 1) == 2 and check_schedule("dualpipev", 2) == 2  # unset (1) or 2
    assert check_schedule("interleaved-zb", 3) == 3 and check_schedule("gpipe", 1) == 1
    # left unset (1), the looped ones take the fewest they run, as the V's do
    assert check_schedule("interleaved-zb", 1) == 2 and check_schedule("interleaved", 1) == 2


@pytest.mark.parametrize(
    ("call", "sentence"),
    [
        (lambda: check_schedule("zbv", 3), "pp_schedule zbv lays exactly 2 stages on each rank in a V (rank r holds "),
        (lambda: check_schedule("1f1b", 2), "pp_stages_per_rank 2 does not fit pp_schedule 1f1b: interleaved and "),
        (lambda: check_schedule("zigzag", 1), "Unknown pp_schedule 'zigzag'; choose one of gpipe, 1f1b, interleaved, "),
        (lambda: check_microbatches("dualpipev", 2, 2, 3), "pp_microbatches 3 is too few for its 4 stages (2 x "),
        (lambda: check_microbatches("dualpipev", 2, 2, None, rows=6), "but a batch of 6 rows with pp_microbatches 4 "),
        (lambda: check_microbatches("interleaved-zb", 2, 2, 5), "runs its micro-batches in 2 equal rounds "),
        (lambda: stage_layers(2, 4, schedule="zbv"), "pp_schedule zbv lays 2 stages on each rank, so pp_size 2 "),
    ],
)
def test_what_a_schedule_cannot_lay_out_or_run_is_one_sentence(call, sentence: str) -> None:
    with pytest.raises(UsageError) as caught:
        call()
    message = str(caught.value)
    assert message.startswith(sentence) or sentence in message, message
    assert message.replace("e.g. ", "").count(". ") == 0 and message.endswith("."), message


def test_a_batch_takes_the_most_micro_batches_its_schedule_runs() -> None:
    """Equal slices, at most the wanted count; dualpipev one per stage at least, interleaved-zb whole rounds."""
    assert microbatch_count("zbv", 2, 2, 4, 3) == 3  # zbv runs any count
    assert microbatch_count("dualpipev", 2, 2, 8, 12) == 6  # 8 does not divide 12; 6 does, and is 4 or more
    assert microbatch_count("interleaved-zb", 2, 2, 5, 10) == 2  # 5 would need 2 equal rounds; 2 is 1 round
    assert microbatch_count("interleaved-zb", 2, 2, 5, 5) == 1
    assert microbatch_count("1f1b", 2, 1, 4, 6) == 3  # the older schedules: as before
    check_microbatches("dualpipev", 2, 2, None, rows=8)  # 4 micro-batches of 2 rows
