"""How a pipeline lays its stages out and runs them: the schedules strategy pp offers, the stages each rank holds,
the micro-batches a batch runs in, and the layers of each stage. Pure arithmetic, read by strategy pp before it
builds anything, by the CLI before any process starts, and by the planner and the simulator.

Stage placement, for pp ranks and v stages per rank (pp x v stages in all):
  looped   gpipe and 1f1b (v = 1), interleaved and interleaved-zb (v >= 2): rank r holds stages r, r + pp, ...
  V        zbv and dualpipev (v = 2, set by the schedule): rank r holds stages r and 2 pp - 1 - r, so the first and
           the last stage share rank 0, and the middle two stages share rank pp - 1 (no send between them).
The zero-bubble schedules (interleaved-zb, zbv, dualpipev) split each backward into its input-gradient half, which
the previous stage waits for, and its weight-gradient half, which nothing waits for and so fills the idle slots.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from multigpu.config.layout import AUTO, split_by_shares
from multigpu.config.settings import StrategyOptions, setting
from multigpu.core.errors import UsageError, require

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
#: Several stages per rank, looped (rank r: r, r + pp, ...): pp_stages_per_rank 2 or more.
LOOPED = ("interleaved", "interleaved-zb")
#: Two stages per rank in a V (rank r: r and 2 pp - 1 - r), which the schedule sets.
V_SHAPED = ("zbv", "dualpipev")
ZERO_BUBBLE = ("interleaved-zb", *V_SHAPED)


@dataclass
class PipelineOptions(StrategyOptions):
    """How a pipeline runs its stages (strategy pp, and zero2, zero3 or hsdp beside pp_size)."""

    pp_schedule: str = setting(
        "1f1b",
        "pp: gpipe (all forwards, then all backwards), 1f1b (less memory), interleaved (several stages per rank, a "
        "smaller bubble), or a zero-bubble schedule, each backward split into its input and weight halves and the "
        "weight halves filling the bubble: interleaved-zb (stages as interleaved), zbv or dualpipev (2 stages per "
        "rank in a V; dualpipev needs at least 2 x pp_size micro-batches); the zero-bubble ones do not run compiled",
        choices=PP_SCHEDULES,
    )
    pp_stages_per_rank: int = setting(
        1,
        "pp: stages per process; interleaved and interleaved-zb take 2 or more (a smaller bubble; 2 when left "
        "unset); zbv and dualpipev set 2 themselves (leave it unset, or give 2); gpipe and 1f1b take 1",
    )
    pp_microbatches: int | None = setting(
        None, "pp: slices of each batch that flow through the pipeline one after another (default: one per stage)"
    )
    pp_split: str | None = setting(
        None,
        "pp: layers per stage, in stage order, e.g. 10,6 to give a faster first GPU more of them (default: as even "
        "as the layers allow); one count per stage (pp_size x pp_stages_per_rank), adding up to the model's layers; "
        "or auto: in proportion to each stage's speed, which its ranks measure at setup",
    )

    def check(self) -> None:
        parse_pp_split(self.pp_split)
        # Whether the schedule and its stages per rank fit is checked where a pipeline is built (check_schedule):
        # under a strategy without pp, the sentence to give is that pp_schedule is pp's option, not how it fits.
        require(
            (
                self.pp_microbatches is None or self.pp_microbatches >= 1,
                f"pp_microbatches must be 1 or more (got {self.pp_microbatches}).",
            )
        )


def check_schedule(schedule: str, stages_per_rank: int) -> int:
    """The stages per rank `schedule` runs (zbv and dualpipev: 2; interleaved and interleaved-zb: 2 where left at the
    default, else what was given); refuses an unknown schedule, or stages per rank that do not fit it."""
    if schedule not in PP_SCHEDULES:
        raise UsageError(f"Unknown pp_schedule {schedule!r}; choose one of {', '.join(PP_SCHEDULES)}.")
    if schedule in V_SHAPED:
        if stages_per_rank not in (1, 2):
            raise UsageError(
                f"pp_schedule {schedule} lays exactly 2 stages on each rank in a V (rank r holds stages r and "
                f"2 x pp_size - 1 - r), not pp_stages_per_rank {stages_per_rank}; leave pp_stages_per_rank unset."
            )
        return 2
    if schedule in LOOPED and stages_per_rank == 1:  # the default: the fewest stages per rank a looped one takes
        return 2
    if stages_per_rank < 1 or (stages_per_rank > 1) != (schedule in LOOPED):
        raise UsageError(
            f"pp_stages_per_rank {stages_per_rank} does not fit pp_schedule {schedule}: interleaved and "
            "interleaved-zb take 2 or more stages per rank, gpipe and 1f1b take 1 (zbv and dualpipev set 2 "
            "themselves); set them together."
        )
    return stages_per_rank


def stage_owners(schedule: str, pp: int, stages_per_rank: int) -> list[int]:
    """The pp rank that holds each stage, in stage order (see the module's docstring)."""
    stages = pp * stages_per_rank
    if schedule in V_SHAPED:
        return [stage if stage < pp else stages - 1 - stage for stage in range(stages)]
    return [stage % pp for stage in range(stages)]


def rank_stages(schedule: str, pp: int, stages_per_rank: int, rank: int) -> list[int]:
    """The stages pp rank `rank` holds, in stage order."""
    return [stage for stage, owner in enumerate(stage_owners(schedule, pp, stages_per_rank)) if owner == rank]


def fits_schedule(schedule: str, pp: int, stages_per_rank: int, micro: int) -> bool:
    """Whether `schedule` runs a step of `micro` micro-batches: dualpipev needs one per stage at least,
    interleaved-zb whole rounds (micro a multiple of micro // pp); the others take any count (1f1b and interleaved
    run a count they cannot take in gpipe's and looped BFS's order, strategies/pp.py)."""
    if schedule == "dualpipev":
        return micro >= pp * stages_per_rank
    if schedule == "interleaved-zb":
        return micro % max(1, micro // pp) == 0
    return True


def microbatch_count(schedule: str, pp: int, stages_per_rank: int, wanted: int, rows: int) -> int:
    """The micro-batches a batch of `rows` runs in: a stage sizes its buffers for one micro-batch shape, so the
    slices are equal; the most, up to `wanted`, that divide the rows and that the schedule takes. Refuses (dualpipev)
    a batch no such count splits."""
    counts = [d for d in range(1, min(wanted, rows) + 1) if rows % d == 0]
    fitting = [d for d in counts if fits_schedule(schedule, pp, stages_per_rank, d)]
    if not fitting:
        stages = pp * stages_per_rank
        raise UsageError(
            f"pp_schedule {schedule} runs at least one micro-batch per stage ({stages}: 2 x pp_size {pp}), but a "
            f"batch of {rows} rows with pp_microbatches {wanted} splits into at most {max(counts)} equal ones; give "
            f"each pipeline a batch_size that a count from {stages} to pp_microbatches divides (e.g. {stages})."
        )
    return max(fitting)


def check_microbatches(
    schedule: str, pp: int, stages_per_rank: int, microbatches: int | None, rows: int | None = None
) -> None:
    """Refuses, before any process starts, pp_microbatches the schedule cannot run, and (given the rows of each
    pipeline's batch) a batch size it cannot split."""
    stages = pp * stages_per_rank
    wanted = microbatches or stages
    if microbatches is not None and not fits_schedule(schedule, pp, stages_per_rank, microbatches):
        if schedule == "dualpipev":
            raise UsageError(
                f"pp_schedule dualpipev runs at least one micro-batch per stage, so pp_microbatches {microbatches} "
                f"is too few for its {stages} stages (2 x pp_size {pp}); give {stages} or more."
            )
        raise UsageError(
            f"pp_schedule interleaved-zb runs its micro-batches in {microbatches // pp} equal rounds "
            f"(pp_microbatches // pp_size {pp}), which pp_microbatches {microbatches} does not divide into; give a "
            f"multiple of {pp}, or fewer than {pp}."
        )
    if rows is not None:
        microbatch_count(schedule, pp, stages_per_rank, wanted, rows)


def parse_pp_split(text: str | None) -> tuple[int, ...] | None:
    """pp_split's layer counts, or None for even (and auto, until measured); one sentence refuses anything else."""
    if text is None or text.strip() == AUTO:
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise UsageError(
            f"pp_split must be auto or whole numbers of layers of at least 1, one per pipeline stage, separated by "
            f"commas (e.g. 10,6), not {text!r}."
        )
    return tuple(int(part) for part in parts)


def stage_layers(
    layers: int, stages: int, split: str | tuple[float, ...] | None = None, schedule: str | None = None
) -> list[range]:
    """The layers each pipeline stage runs, in order: pp_split's counts, in proportion to the stages' speeds where
    `split` gives them (measured: pp_split auto), else as even as they allow. Refuses more stages than layers
    (naming `schedule` where it set the stages per rank), or counts that are not one per stage adding up to the
    layers. The CLI asks this of the model's config before any process starts; strategy pp of the model it builds."""
    if layers < stages and schedule in V_SHAPED:
        raise UsageError(
            f"pp_schedule {schedule} lays 2 stages on each rank, so pp_size {stages // 2} makes {stages} stages, "
            f"more than the model's {layers} layers; choose a pp_size of at most {layers // 2}, another schedule, or "
            "a model with more layers."
        )
    if layers < stages:
        raise UsageError(
            f"The model's {layers} layers cannot fill {stages} pipeline stages (pp_size x pp_stages_per_rank); "
            f"choose a pp_size and pp_stages_per_rank whose product is at most {layers}."
        )
    counts = tuple(split_by_shares(layers, split)) if isinstance(split, tuple) else parse_pp_split(split)
    if counts is None:
        base, extra = divmod(layers, stages)
        counts = tuple(base + (1 if stage < extra else 0) for stage in range(stages))
    elif len(counts) != stages or sum(counts) != layers:
        raise UsageError(
            f"pp_split {split} names {len(counts)} stage{'s' if len(counts) > 1 else ''} of {sum(counts)} layers in "
            f"all, but the pipeline has {stages} stages (pp_size x pp_stages_per_rank) and the model {layers} layers; "
            f"give {stages} counts adding up to {layers}."
        )
    bounds = [0, *itertools.accumulate(counts)]
    return [range(start, stop) for start, stop in itertools.pairwise(bounds)]
