"""Which of torch's pipeline schedules runs a step, and the stage class the V-shaped ones need.

config/pipeline.py says which stages each rank holds and how many micro-batches a batch runs in; this module turns
a schedule's name into torch.distributed.pipelining's class for one step of `micro` micro-batches.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)


class VStage(PipelineStage):
    """A stage of a V (zbv, dualpipev). Rank pp - 1 holds the V's two middle stages, which torch joins without a send:
    its runtime hands the backward input of one to the other even when evaluating (forward only), and torch 2.13's
    stage refuses that outside training. Forward only there is no gradient to hand over, so nothing is."""

    def get_local_bwd_output(self, mb_index: int) -> Any:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def schedule_class(schedule: str, pp: int, stages_per_rank: int, micro: int, train: bool) -> type:
    """torch's schedule for one step of `micro` micro-batches under `schedule` on `pp` ranks.

    gpipe, 1f1b and interleaved: for a batch too short for 1f1b or interleaved (fewer micro-batches than 1f1b has
    stages, or than interleaving fills in whole rounds), the all-forwards-then-all-backwards order of their stage
    layout: the same gradients, and no more activations in flight than the configured schedule would hold with
    enough micro-batches. The zero-bubble schedules run only counts they take (config/pipeline.py refuses the rest).
    Evaluation (forward only) under dualpipev runs the V's forwards in zbv's order: dualpipev pairs each forward with
    another micro-batch's backward, and forward only there is none, so it would only add its micro-batch minimum."""
    if schedule == "interleaved":
        rounds = max(1, micro // pp)
        return ScheduleInterleaved1F1B if micro >= pp and micro % rounds == 0 else ScheduleLoopedBFS
    if schedule == "1f1b":
        return Schedule1F1B if micro >= pp * stages_per_rank else ScheduleGPipe
    if schedule == "interleaved-zb":
        return ScheduleInterleavedZeroBubble
    if schedule == "zbv" or (schedule == "dualpipev" and not train):
        return ScheduleZBVZeroBubble
    if schedule == "dualpipev":
        return ScheduleDualPipeV
    return ScheduleGPipe
