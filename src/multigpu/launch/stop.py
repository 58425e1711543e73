"""Stopping a run: a signal stops every worker and ends in one line naming the last complete checkpoint; workers
die with their launcher.

A run in the CLI's own process (`raising_stopped`): SIGINT and SIGTERM raise `Stopped` in the main thread, and the
CLI turns it into the one line and exit code 130 / 143. Python drops an exception raised while a finalizer runs
("Exception ignored in ...") and some code catches everything, so a stop that has not ended the run a few seconds
later ends the process anyway: checkpoints are written whole or not at all, so nothing complete is lost.

The launcher side: torch elastic turns SIGINT / SIGTERM into a SignalException in the agent (the launcher's own
process) once workers run, sends the same signal to each worker's process group, then SIGKILLs what is left after
its shutdown timeout. `raising_on_stop` makes a signal that comes earlier (during the rendezvous) raise the same
exception, and `report_stop` prints the one line.

The worker side (multigpu.launch.worker calls both at start-up, before the script runs):
- `end_at_once_on_stop`: a Python handler only runs between bytecodes of the main thread, so a worker blocked in
  a C++ collective would wait out the launcher's shutdown timeout before being killed, and one that is not
  prints a KeyboardInterrupt traceback; the kernel's default action ends it at once, without either.
- `die_with_launcher`: workers run in sessions of their own, so a launcher killed by SIGKILL (which it cannot
  forward) would leave them training; the kernel kills them instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing.api import SignalException

from multigpu.core.atomic import causes
from multigpu.core.child_processes import die_with_parent
from multigpu.core.launcher_notes import LAST_CHECKPOINT, launcher_note

#: Set by `multigpu run` for its own workers (not a user setting): the launcher's pid.
LAUNCHER_PID = "MULTIGPU_LAUNCHER_PID"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 10.0  # how long a stop in this process may take before it ends the process itself


class Stopped(BaseException):
    """SIGINT or SIGTERM in a run in this process (a BaseException, as KeyboardInterrupt: no `except Exception`
    swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stopped_line(signum: int) -> str:
    from multigpu import checkpoint  # here, not above: see stop_signal

    last = checkpoint.last_committed()
    saved = f"the last complete checkpoint is {last}" if last else "no checkpoint was completed in this run"
    return f"multigpu: stopped by {signal.Signals(signum).name}; {saved}."


def _stop_here(signum: int, frame: FrameType | None) -> None:
    def end_anyway() -> None:
        print(stopped_line(signum), file=sys.stderr, flush=True)
        os._exit(128 + signum)

    timer = threading.Timer(STOP_GRACE_S, end_anyway)
    timer.daemon = True  # a run that stops in time exits without waiting for it
    timer.start()
    raise Stopped(signum)


def raising_stopped() -> contextlib.AbstractContextManager[None]:
    """Within it, SIGINT and SIGTERM raise Stopped (see the module's doc); the previous handlers come back after."""
    return handling_stops(_stop_here)


@contextlib.contextmanager
def handling_stops(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """Within it, `handler` takes SIGINT and SIGTERM (in the main thread; elsewhere nothing changes); the handlers
    before come back after."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_signal(error: BaseException) -> int | None:
    """The signal that stopped this process, if `error` is (or wraps) a stop. It may surface wrapped: DCP collects
    each rank's exception into its own, and a file being written may fail on its way out in its place."""
    for cause in causes(error):
        if isinstance(cause, Stopped):
            return cause.signum
        if isinstance(cause, KeyboardInterrupt):
            return signal.SIGINT
    return None


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def raising_on_stop() -> contextlib.AbstractContextManager[None]:
    """Within it, SIGINT and SIGTERM raise SignalException, as torch elastic's own handler does once workers run.

    The handlers in place before are restored on the way out (torch elastic leaves its own installed).
    """
    return handling_stops(_raise_stop)


def checkpoint_note(exits: Path) -> str | None:
    """`the last complete checkpoint is PATH`, from the note a worker left when it committed one; else None."""
    path = launcher_note(exits, LAST_CHECKPOINT)
    return f"the last complete checkpoint is {path}" if path else None


def report_stop(sig: signal.Signals, exits: Path) -> int:
    """Prints the one line that says the run was stopped; returns the shell's code for that signal (130 for SIGINT)."""
    # Only the checkpoints engine.save commits are known here: a script's own torch.save is not, so say nothing then.
    saved = f"; {checkpoint_note(exits)}" if checkpoint_note(exits) else ""
    print(f"multigpu run: stopped by {sig.name}; every worker was stopped{saved}.", file=sys.stderr)
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
    if launcher is None or not die_with_parent():
        return  # not launched, or a kernel that refuses it: the worker lives on as before
    # The launcher may have died before prctl took effect; this process was then handed to another parent.
    # Checked on the launcher too, so that a process between them (none today: torch's numactl wrapper execs)
    # cannot make a worker kill itself.
    if os.getppid() != int(launcher) and not alive(int(launcher)):
        os.kill(os.getpid(), signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (dead, its parent has not collected it yet) does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
