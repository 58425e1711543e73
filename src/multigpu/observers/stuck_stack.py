"""A stuck rank's own stack: written to the run's log folder rather than the screen, where the waiting rank's one
sentence is all the user reads, and a rank stopped by a signal (SIGSTOP, a Ctrl-Z of that one process) continued
first, so that its heartbeat can write it (multigpu.observers.progress)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path


def this_process() -> str:
    """`host:pid`, posted with each rank's whereabouts so that a rank on the same machine can continue it."""
    return f"{socket.gethostname()}:{os.getpid()}"


PF_EXITING = 0x4  # the kernel's flag for a task inside exit(): set before it frees its memory and closes its sockets


def ended_here(process: str) -> bool:
    """Whether `process` (`host:pid`) ran on this machine and has ended or is ending (a zombie its parent has not
    reaped yet, or a task inside exit(), whose sockets close once its memory is freed: a request sent meanwhile is
    reset); False for a process elsewhere, which this machine cannot see."""
    host, _, pid = process.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here: the signal-0 probe, which a zombie passes
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False
    # The state follows the command's closing parenthesis; the flags are the sixth field after it.
    fields = stat.rpartition(")")[2].split()
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)


def continue_stopped(processes: list[str]) -> None:
    """Sends SIGCONT to those of `processes` (`host:pid`) on this machine: a stopped rank cannot say where it is,
    and the run is ending anyway; a rank that runs ignores it."""
    here = socket.gethostname()
    for process in processes:
        host, _, pid = process.rpartition(":")
        if host == here and pid.isdigit():
            with contextlib.suppress(OSError):  # it has ended meanwhile, or is another user's
                os.kill(int(pid), signal.SIGCONT)


def stack_file(log_dir: str | None, rank: int) -> Path | None:
    return None if log_dir is None else Path(log_dir) / f"stack-rank{rank}.txt"


def where_written(log_dir: str | None, ranks: list[int]) -> str:
    """How the waiting rank's sentence says where the stacks of `ranks` went."""
    one = len(ranks) == 1
    if log_dir is None:
        return f"{'it' if one else 'they'} printed {'its' if one else 'their'} stack"
    files = ", ".join(str(stack_file(log_dir, rank)) for rank in ranks)
    return f"{'its' if one else 'their'} stack{'' if one else 's'} {'is' if one else 'are'} in {files}"


def write_stack(log_dir: str | None, rank: int, header: str) -> None:
    """Writes `header` and this process's main-thread stack to the log folder's file for `rank` (printed without a
    log folder: a script's Engine may have none)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (not found)\n"
    text = f"multigpu: {header}; its main thread is here:\n{stack}"
    path = stack_file(log_dir, rank)
    if path is None:
        print(text, end="", file=sys.stderr, flush=True)
        return
    with contextlib.suppress(OSError):  # a log folder that cannot take it: the sentence on screen still stands
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
