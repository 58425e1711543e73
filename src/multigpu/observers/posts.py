"""What each rank posts to the store about where its main thread is (Where), and what a rank that timed out in a
collective tells the user from every rank's post (describe)."""

from __future__ import annotations

import json
from typing import NamedTuple


class Where(NamedTuple):
    """Where a rank was when it last posted."""

    step: int  # optimizer steps finished
    micro_step: int  # micro-steps begun (backward calls)
    op: str | None  # the collective it is inside; None outside any
    for_s: float  # how long it had been there (its own clock: machines' clocks differ)
    calls: int = 0  # Engine calls and model forwards begun (not those inside another)
    history: tuple = ()  # the last of them: (op, the user's file:line that made it)
    blocked_s: float = 0.0  # how long its main thread has waited inside the current call (divergence.MainClock)
    finished: bool = False  # its script has ended
    process: str = ""  # host:pid (stuck_stack.continue_stopped)
    failed: bool = False  # its script raised an error of its own, which the launcher reports: no divergence
    beats: int = 0  # its heartbeat's posts so far: unchanged between two reads a beat apart, its process is stopped

    def __str__(self) -> str:
        return f"optimizer step {self.step} (micro-step {self.micro_step})"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _whereabouts(rank: int, where: Where | None, frozen: bool) -> str:
    if where is None:
        return f"rank {rank} never posted where it is (it died, or stopped before its first backward)"
    if frozen:  # its last post may be a beat old: where its main thread was then, not where it stopped
        return (
            f"rank {rank} stopped reaching collectives after {where} or soon after, its heartbeat stopped too (the "
            "whole process is stopped: a signal, a debugger, a C call that holds the GIL, a machine that froze)"
        )
    if where.op is None:
        return (
            f"rank {rank} stopped reaching collectives after {where} and has been outside any collective for "
            f"{where.for_s:.1f}s"
        )
    return f"rank {rank} is inside a different collective, {where.op}, after {where}"


def describe(
    me: int,
    timeout_s: float,
    posts: dict[int, Where | None],
    stacks: str | None = None,
    frozen: frozenset[int] = frozenset(),
) -> tuple[str, list[int]]:
    """What rank `me`, timed out in a collective, tells the user from every rank's post; and the ranks it names.
    `stacks`: where the ranks named have shown their stacks (stuck_stack.where_written); `frozen`: the ranks whose
    posts stopped changing."""
    mine = posts[me]
    waiting = [rank for rank, where in posts.items() if where is not None and where[:3] == mine[:3]]
    absent = [rank for rank in posts if rank not in waiting]
    if not absent:
        return (
            f"A collective in {mine.op} on rank {me} (micro-step {mine.micro_step}) timed out after {timeout_s:g}s "
            "although every rank is inside it at the same micro-step: the ranks issued different collectives in it "
            "(a rank-only branch, parameters that some ranks did not use?) or the network failed.",
            [],
        )
    whereabouts = "; ".join(_whereabouts(rank, posts[rank], rank in frozen) for rank in absent)
    who = "that rank does" if len(absent) == 1 else "those ranks do"
    return (
        f"{whereabouts[0].upper()}{whereabouts[1:]}, while {_ranks(waiting)} waited in {mine.op} (micro-step "
        f"{mine.micro_step}) past the {timeout_s:g}s timeout: look at what {who} from there (a hang, a deadlock, "
        f"a much slower data path{f'; {stacks}' if stacks else ''}). The launcher stops every process.",
        absent,
    )


def frozen(first: dict[int, Where | None], second: dict[int, Where | None]) -> frozenset[int]:
    """The ranks whose heartbeat did not post between two reads of every post more than a beat apart."""
    return frozenset(
        rank for rank, where in second.items() if where is not None and first.get(rank) is not None
        and where.beats == first[rank].beats and not where.finished
    )  # fmt: skip


def where_of(value: bytes) -> Where:
    fields = json.loads(value)
    if len(fields) > 5:
        fields[5] = tuple(tuple(call) for call in fields[5])  # JSON gives lists back
    return Where(*fields)
