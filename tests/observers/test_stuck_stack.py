"""Whether the process serving the store has ended: a peer's heartbeat stops posting to a store that is going away,
whose closed socket would make c10d print a warning with 20-odd C++ frames."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from multigpu.observers import stuck_stack
from multigpu.observers.stuck_stack import ended_here, this_process


def test_a_running_process_has_not_ended_and_a_zombie_has() -> None:
    assert not ended_here(this_process())
    child = subprocess.Popen(["true"])
    time.sleep(0.5)  # exited, not yet reaped: a zombie
    assert ended_here(f"{socket.gethostname()}:{child.pid}")
    child.wait()
    assert ended_here(f"{socket.gethostname()}:{child.pid}")  # reaped: gone
    assert not ended_here(f"another-host:{os.getpid()}")  # elsewhere: this machine cannot tell


@pytest.mark.parametrize(("flags", "ending"), [(0x400100, False), (0x400104, True)])
def test_a_process_inside_exit_counts_as_ended_before_it_is_a_zombie(
    monkeypatch: pytest.MonkeyPatch, flags: int, ending: bool
) -> None:
    """SIGKILL sets PF_EXITING at once; the sockets close only after the process's memory is freed, and it turns
    zombie after that: a request to its store in between is reset."""
    stat = f"4242 (python (rank 0)) R 1 4242 4242 0 -1 {flags} 9 0 0 0 5 3 0 0 20 0 2 0 100 0 0\n"
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda path, *a, **k: stat if str(path) == "/proc/4242/stat" else real(path))
    assert stuck_stack.ended_here(f"{socket.gethostname()}:4242") is ending
