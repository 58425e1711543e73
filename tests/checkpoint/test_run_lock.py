"""One run per save directory: a live holder is named in the refusal; a dead one's lock is taken over."""

from __future__ import annotations

import os
import re
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
    refused = pytest.raises(
        UsageError, match=r"in use by another run \(pid 4242 on host other-host, .* renewed 0 s ago"
    )
    with refused, run_lock.holding(tmp_path):
        pass
    stale = time.time() - run_lock.STALE_S - 1
    os.utime(lock, (stale, stale))
    with run_lock.holding(tmp_path):
        assert lock.read_text().startswith(f"{os.getpid()}\n{socket.gethostname()}\n")


def test_another_hosts_lock_dated_in_the_future_says_so_and_what_to_remove(tmp_path: Path) -> None:
    lock = tmp_path / run_lock.LOCK
    lock.write_text("4242\nother-host\n2027-01-01 00:00:00 UTC\n")
    ahead = time.time() + 3600
    os.utime(lock, (ahead, ahead))
    with pytest.raises(UsageError) as refused, run_lock.holding(tmp_path):
        pass
    assert re.fullmatch(
        rf"--save-dir {tmp_path} is in use by another run \(pid 4242 on host other-host, started 2027-01-01 00:00:00 "
        r"UTC, its lock dated 3[56]\d\d s ahead of this host's clock\); wait for it to end or stop it, remove "
        rf"{lock} if that run is gone, or choose another --save-dir\.",
        str(refused.value),
    )


def test_a_lock_that_is_a_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / run_lock.LOCK).mkdir()
    with pytest.raises(UsageError) as refused, run_lock.holding(tmp_path):
        pass
    assert str(refused.value) == (
        f"--save-dir {tmp_path} has a directory named .run.lock, where a run keeps its lock file; remove "
        f"{tmp_path / run_lock.LOCK}, or choose another --save-dir."
    )
