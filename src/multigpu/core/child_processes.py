"""Processes this one forks (a multiprocessing pool's workers): quiet on Ctrl-C, and dead with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

_forking_quietly = 0  # how many `children_leave_stops_to_parent` are open in this process


def _after_fork_in_child() -> None:
    global _forking_quietly
    if _forking_quietly:
        _forking_quietly = 0  # what this child forks in turn is its own business
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def children_leave_stops_to_parent() -> Iterator[None]:
    """Within it, the processes this one forks (a multiprocessing pool's workers) ignore SIGINT, end silently on
    SIGTERM, and die with it. Ctrl-C reaches every process of the terminal's group: each pool worker would print a
    KeyboardInterrupt traceback of its own, while this process stops in one line and ends the pool (SIGTERM)."""
    global _forking_quietly
    _forking_quietly += 1
    try:
        yield
    finally:
        _forking_quietly -= 1


def die_with_parent() -> bool:
    """Asks the kernel to SIGKILL this process when the thread that started it ends; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
