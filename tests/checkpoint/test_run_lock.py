"""One run per save directory: a live holder is named in the refusal; a dead one's lock is taken over."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from multigpu.checkpoint import run_lock
from multigpu.core.errors import UsageError


def test_a_held_directory_is_refused_naming_its_holder_and_freed_after(tmp_path: Path) -> None:
    with run_lock.holding(tmp_path):
        os.environ.pop(run_lock.HELD)  # as another process would see it
        with pytest.raises(UsageError) as refused, run_lock.holding(tmp_path):
            pass
        assert f"--save-dir {tmp_path} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in (
            str(refused.value)
        )
        os.environ[run_lock.HELD] = str(tmp_path.resolve())
    assert run_lock.HELD not in os.environ and not any(tmp_path.iterdir())  # nothing left behind
    with run_lock.holding(tmp_path):
        pass


def test_another_hosts_lock_is_stale_once_unrenewed(tmp_path: Path) -> None:
    """Where flocks do not reach across hosts, another host's lock counts while its holder renews it."""
    lock = tmp_path / run_lock.LOCK
    lock.write_text("4242\nother-host\n2025-01-01 00:00:00 UTC\n")
    refused = pytest.raises(UsageError, match="in use by another run \\(pid 4242 on host other-host")
    with refused, run_lock.holding(tmp_path):
        pass
    stale = time.time() - run_lock.STALE_S - 1
    os.utime(lock, (stale, stale))
    with run_lock.holding(tmp_path):
        assert lock.read_text().startswith(f"{os.getpid()}\n{socket.gethostname()}\n")
