"""Stopping a `multigpu run`: a signal to the launcher stops every worker and ends in one line; workers die with it.

The launcher side: torch elastic turns SIGINT / SIGTERM into a SignalException in the agent (the launcher's own
process) once workers run, sends the same signal to each worker's process group, then SIGKILLs what is left after
its shutdown timeout. `raising_on_stop` makes a signal that comes earlier (during the rendezvous) raise the same
exception, and `report_stop` prints the one line.

The worker side (multigpu.worker calls both at start-up, before the script runs):
- `end_at_once_on_stop`: a Python handler only runs between bytecodes of the main thread, so a worker blocked in
  a C++ collective would wait out the launcher's shutdown timeout before being killed, and one that is not
  prints a KeyboardInterrupt traceback; the kernel's default action ends it at once, without either.
- `die_with_launcher`: workers run in sessions of their own, so a launcher killed by SIGKILL (which it cannot
  forward) would leave them training; the kernel kills them instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing.api import SignalException

from multigpu.env import LAST_CHECKPOINT, launcher_note

#: Set by `multigpu run` for its own workers (not a user setting): the launcher's pid.
LAUNCHER_PID = "MULTIGPU_LAUNCHER_PID"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


@contextlib.contextmanager
def raising_on_stop() -> Iterator[None]:
    """Within it, SIGINT and SIGTERM raise SignalException, as torch elastic's own handler does once workers run.

    The handlers in place before are restored on the way out (torch elastic leaves its own installed).
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def checkpoint_note(exits: Path) -> str | None:
    """`the last complete checkpoint is PATH`, from the note a worker left when it committed one; else None."""
    path = launcher_note(exits, LAST_CHECKPOINT)
    return f"the last complete checkpoint is {path}" if path else None


def report_stop(sig: signal.Signals, exits: Path) -> int:
    """Prints the one line that says the run was stopped; returns the shell's code for that signal (130 for SIGINT)."""
    checkpoint = checkpoint_note(exits) or "no checkpoint was completed in this run"
    print(f"multigpu run: stopped by {sig.name}; every worker was stopped; {checkpoint}.", file=sys.stderr)
    return 128 + sig


def end_at_once_on_stop() -> None:
    """A worker ends at once on SIGINT or SIGTERM, without a traceback (see the module's doc for why)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def die_with_launcher() -> None:
    """Asks the kernel to SIGKILL this worker when the launcher that started it ends, however it ends.

    PR_SET_PDEATHSIG fires when the *thread* that started this process ends: torch elastic starts every worker,
    restarted ones included, from the launcher's main thread (its agent runs there), which ends with the process.
    """
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # a kernel that refuses it: the worker lives on as before
    # The launcher may have died before prctl took effect; this process was then handed to another parent.
    # Checked on the launcher too, so that a process between them (none today: torch's numactl wrapper execs)
    # cannot make a worker kill itself.
    if os.getppid() != int(launcher) and not _alive(int(launcher)):
        os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (dead, its parent has not collected it yet) does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
