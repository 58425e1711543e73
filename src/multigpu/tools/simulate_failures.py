"""`multigpu simulate --mtbf-hours`: the goodput under failures (planner/failures.py) at each GPU count simulated,
restart from checkpoint against in place, as rows for the JSON and as a table and what it assumes."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from multigpu.planner.failures import (
    Failures,
    FailureSettings,
    failures_at,
    heal_s,
    in_place_goodput,
    restart_goodput,
)

if TYPE_CHECKING:
    from rich.table import Table

    from multigpu.planner.simulate import Prediction


def failure_rows(
    settings: FailureSettings, gpus_per_node: int, params: float, predictions: list[Prediction]
) -> list[dict[str, Any]]:
    """One row per prediction: its Failures, and each way's Goodput (in place's None under two replica groups); []
    without --mtbf-hours."""
    if settings.mtbf_hours is None:
        return []
    rows = []
    for p in predictions:
        failures = failures_at(settings, p.gpus, p.step_s, params, gpus_per_node)
        in_place = in_place_goodput(failures)
        rows.append(
            {
                "failures": asdict(failures),
                "job_mtbf_h": failures.mtbf_s / failures.gpus / 3600,
                "heal_s": heal_s(failures),
                "restart": asdict(restart_goodput(failures)),
                "in_place": None if in_place is None else asdict(in_place),
            }
        )
    return rows


def failure_table(rows: list[dict[str, Any]]) -> Table:
    """The rows as a rich table (`assumptions` says what they assume)."""
    from rich.table import Table

    first = Failures(**rows[0]["failures"])
    table = Table(title=f"Goodput under failures, MTBF {first.mtbf_s / 3600:,.0f} h per GPU")
    columns = ("GPUs", "job MTBF h", "step s", "restart:\nsave every", "restart:\nlost s/failure", "restart:\ngoodput")
    for column in (*columns, "in place:\ngroup away s", "in place:\nlost s/failure", "in place:\ngoodput"):
        table.add_column(column, justify="right")
    for row in rows:
        failures, restart, in_place = Failures(**row["failures"]), row["restart"], row["in_place"]
        table.add_row(
            f"{failures.gpus:,}",
            f"{row['job_mtbf_h']:,.2f}",
            f"{failures.step_s:.4g}",
            every(restart["steps_between_saves"], restart["interval_s"]),
            f"{restart['lost_per_failure_s']:,.1f}",
            f"{restart['goodput']:.3%}",
            "-" if in_place is None else f"{failures.restart_s + row['heal_s']:,.1f}",
            "-" if in_place is None else f"{in_place['lost_per_failure_s']:,.2f}",
            "-" if in_place is None else f"{in_place['goodput']:.3%}",
        )
    return table


def every(steps: float, interval_s: float) -> str:
    """'610 s (1,234 steps)', or 'never' without failures."""
    return f"{interval_s:,.0f} s ({steps:,.0f} steps)" if math.isfinite(interval_s) else "never"


def assumptions(rows: list[dict[str, Any]]) -> str:
    """What the table assumes, a line for each way (in place's '-': under two replica groups, no peer to heal
    from)."""
    f = Failures(**rows[0]["failures"])
    interval = "as given" if f.interval_s is not None else "Young/Daly's sqrt(2 x save x job MTBF)"
    return (
        f"restart from checkpoint, per failure: detect {f.detect_s:g} s + restart {f.restart_s:g} s + load "
        f"{f.load_s:.3g} s + half an interval; a save of {f.state_bytes / 1e9:.3g} GB holds {f.save_s:.3g} s per "
        f"interval ({interval})\n"
        f"in place, per failure: heartbeat {f.heartbeat_s:g} s + a step again; a replica group of {f.group_gpus} "
        f"GPUs away for the restart and its heal at {f.heal_Bps * 8 / 1e9:g} Gb/s per GPU; saves hourly or rarer\n"
    )
