"""Ranks that went different ways: one evaluates alone, saves alone, or leaves the loop a batch early.

Each rank's heartbeat (multigpu.observers.progress) posts, beside its step, the Engine call or model forward its main
thread is inside, the user's line that made it (`call_site`), how many such calls it has made and the last few of
them, and for how long its main thread has been blocked: its CPU clock standing still inside a call (a gloo
collective waits on a condition variable, it does not spin; measured: the clock stays put to the millisecond).

`diverged` decides from every rank's post: when every rank is blocked inside a call for BLOCKED_S, or has finished
its script, and they are not all at the same call, no rank can ever go on: the collectives they wait in will never
pair up. The first rank to see it for CONFIRM_S claims the verdict in the store (exactly one rank says it), the
launcher prints its one sentence, and every rank ends quietly with exit code DIVERGED_EXIT, long before the
collective timeout (30 min by default). A rank that is computing (its clock advances: a slow data path, a long
evaluation) or ranks blocked at the same call (one rank still writing its part of a checkpoint, a network fault)
are never a divergence: those wait for the timeout, as before.

A collective that fails instead (gloo raises when a peer left, and aborts a rank whose data has another size: its
own two C++ lines are then all that rank prints) gives the same sentence, from the posts as they stand, in place of
the traceback (`from_a_collective`). gloo only: under NCCL the heartbeat acts on nothing (multigpu.observers.progress).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BLOCKED_S = 3.0  # a main thread whose CPU clock stood still this long inside a call is waiting, not working:
# longer than any stall of a working collective on a loaded machine, short enough to answer within seconds
CONFIRM_S = 1.0  # the same verdict seen by two beats this far apart: posts lag by one beat (0.5 s) at most
CPU_SLACK_S = 0.05  # CPU time a waiting thread may still use (gloo's wake-ups) and count as standing still
HISTORY = 8  # the last calls each rank posts, to find the one where the ranks parted
DIVERGED_EXIT = 2  # a mistake in the script, as a UsageError: every rank ends with it
EVALUATION = "evaluation forward"  # the op of a model forward without gradients

_LABELS = {
    "model forward": "a model forward",
    EVALUATION: "a model forward without gradients (evaluation?)",
    "backward": "engine.backward",
    "optimizer step": "engine.step",
    "pipeline step": "engine.forward_backward",
    "save": "engine.save",
    "load": "engine.load",
    "reduce": "engine.reduce",
    "gather": "engine.gather",
    "barrier": "engine.barrier",
    "step totals": "engine.step",
}
# Frames of multigpu, torch, the standard library (contextlib's) and code without a file are not the user's.
_OURS = (*(os.path.dirname(module.__file__) + os.sep for module in (torch, sys.modules["multigpu"], os)), "<")


def label(op: str) -> str:
    return _LABELS.get(op, f"engine {op}")


# code object -> its file's name where it is the user's, "" where it is multigpu's, torch's or the standard library's
_FILES: dict[Any, str] = {}


def call_site(skip: int = 0) -> str:
    """The user's line that made the call the main thread is in: its first frame outside multigpu, torch and the
    standard library, as `file.py:LINE`. Each code object is judged once: this runs at every Engine call. `skip`:
    how many frames, its caller's first, the caller knows are multigpu's: jumped over without making each a frame
    object, which is most of what a walk costs (measured: ~8 microseconds a step of three Engine calls)."""
    try:
        frame = sys._getframe(1 + skip)
    except ValueError:  # a stack shallower than that: no user's line in it
        return "an unknown line"
    while frame is not None:
        code = frame.f_code
        name = _FILES.get(code)
        if name is None:
            ours = code.co_filename.startswith(_OURS)
            name = _FILES[code] = "" if ours else os.path.basename(code.co_filename)
        if name:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown line"


class MainClock:
    """How long the main thread's CPU clock has stood still within one call (0 where it cannot be read)."""

    def __init__(self) -> None:
        try:
            self._clock: int | None = time.pthread_getcpuclockid(threading.main_thread().ident)
        except (AttributeError, OSError):
            self._clock = None  # not Linux: never blocked, never a divergence
        self._since: tuple[Any, float, float] | None = None  # (the call, CPU time, monotonic) when it stopped

    def blocked_s(self, call: Any) -> float:
        if self._clock is None or call is None:
            self._since = None
            return 0.0
        cpu, now = time.clock_gettime(self._clock), time.monotonic()
        if self._since is None or self._since[0] != call or cpu - self._since[1] > CPU_SLACK_S:
            self._since = (call, cpu, now)
        return now - self._since[2]


def _place(where: Any) -> tuple:
    if where.finished:
        return ("finished",)
    last = tuple(where.history[-1]) if where.history and where.op is not None else None
    return (last, where.step, where.micro_step)


def diverged(posts: Mapping[int, Any], after_error: bool = False) -> str | None:
    """The sentence that says the ranks parted ways, or None: every rank posted, is blocked inside a call for
    BLOCKED_S or has finished (`after_error`: a collective already failed, so no waiting is needed), and they are
    not all at the same place (their call, its line, step and micro-step)."""
    if not posts or any(where is None or where.failed for where in posts.values()):
        return None  # a rank that never posted: nothing to compare; one that crashed: the launcher reports it
    if all(where.finished for where in posts.values()):
        return None
    waiting = (where.finished or (where.op is not None and where.blocked_s >= BLOCKED_S) for where in posts.values())
    if not after_error and not all(waiting):
        return None
    if len({_place(where) for where in posts.values()}) < 2:
        return None
    if not after_error and parted(posts) is None and not _past_the_finished(posts):
        # Only some ranks ahead, over the same calls: the ones behind are still inside a call the others finished,
        # doing their own part of it (rank 0 syncing a checkpoint to a slow disk stands as still as a wait). Ranks
        # that went different ways made different calls, or wait in a call a finished rank will never make.
        return None
    return sentence(posts)


def _past_the_finished(posts: Mapping[int, Any]) -> bool:
    """Whether a rank waits in a call beyond the last call of a rank that has finished its script."""
    ended = [where.calls for where in posts.values() if where.finished]
    return bool(ended) and any(w.op is not None and w.calls > min(ended) for w in posts.values() if not w.finished)


def parted(posts: Mapping[int, Any]) -> int | None:
    """The first call (counted from 1) that not every rank made alike, among the last ones they all posted."""
    first = max(where.calls - len(where.history) + 1 for where in posts.values())
    last = min(where.calls for where in posts.values())
    for call in range(first, last + 1):
        if len({tuple(where.history[call - where.calls - 1]) for where in posts.values()}) > 1:
            return call
    return None


def _made(rank: int, where: Any, call: int) -> str:
    if where.calls < call:  # it never made it, or its post is older than the call
        return f"rank {rank} {'never made it' if where.finished else 'had not posted it'}"
    if where.calls - len(where.history) >= call:
        return f"rank {rank} made a call no longer in its post"
    op, site = where.history[call - where.calls - 1]
    return f"rank {rank} made {label(op)} at {site}"


def _now(rank: int, where: Any) -> str:
    if where.finished:
        return f"rank {rank} has finished its script"
    if not where.history:
        return f"rank {rank} had made no Engine call or model forward when it last posted"
    op, site = where.history[-1]
    at = f"at {site} (optimizer step {where.step}, micro-step {where.micro_step})"
    if where.op is None:  # a collective raised and unwound it, or its post is older than its next call
        return f"rank {rank} last made {label(op)} {at}"
    return f"rank {rank} waits in {label(op)} {at}"


def _culprit(posts: Mapping[int, Any]) -> int | None:
    """The call to name where no call the ranks all posted differs (a rank's post is older than its last calls:
    gloo may end a rank at once): the first evaluation forward past them, else the first call past them."""
    common = min(where.calls for where in posts.values())
    if len({where.calls for where in posts.values()}) < 2:
        return None
    for where in posts.values():
        for index, (op, _) in enumerate(where.history):
            call = where.calls - len(where.history) + 1 + index
            if call > common and op == EVALUATION:
                return call
    return common + 1


def sentence(posts: Mapping[int, Any]) -> str:
    ranks = sorted(posts)
    now = ", ".join(_now(rank, posts[rank]) for rank in ranks)
    call = parted(posts)
    call = _culprit(posts) if call is None else call
    went = ""
    if call is not None and call > 0:
        made = ", ".join(_made(rank, posts[rank], call) for rank in ranks)
        went = f" at call {call} (Engine calls and model forwards counted), where {made}"
    return (
        f"The ranks went different ways{went}, so the collectives they wait in never pair up: {now}; every rank "
        "must make the same Engine calls and model forwards in the same order: evaluate and save on every rank, "
        "and give every rank as many batches (engine.dataloader does)."
    )


def watch_forwards(model: nn.Module, enter: Callable[[str], Any], leave: Callable[[Any], None]) -> None:
    """Makes every forward of the set-up `model` a call, whoever makes it (under zero3 an evaluation on one rank
    all-gathers): its pre-hook goes first, before FSDP's, whose all-gather would otherwise run outside it."""
    outer: list[Any] = []

    # A script's own torch.compile(model) traces hooks: under it these do nothing, so nothing of theirs enters its
    # graph (torch.compiler.disable would do that too, at ~10 microseconds a call on every forward).
    def entered(module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            outer.append(enter("model forward" if torch.is_grad_enabled() else EVALUATION))

    def left(module: nn.Module, args: Any, output: Any) -> None:
        if outer and not torch.compiler.is_compiling():
            leave(outer.pop())

    model.register_forward_pre_hook(entered, prepend=True)
    model.register_forward_hook(left, always_call=True)


def from_a_collective(error: BaseException) -> bool:
    """Whether `error` is a collective's failure: gloo's (raised from DDP's C++ reducer too), a c10d backend's, or
    one raised by torch.distributed's collective calls themselves. An error that only passed through
    torch.distributed (DTensor's dispatch, FSDP's hooks: a script's own mistake) is not: its traceback is shown."""
    if not isinstance(error, RuntimeError):
        return False
    if "gloo" in str(error).lower() or isinstance(error, dist.DistError):
        return True
    innermost = error.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    return innermost is not None and innermost.tb_frame.f_code.co_filename.endswith(_COLLECTIVES)


_COLLECTIVES = os.path.join("torch", "distributed", "distributed_c10d.py")
