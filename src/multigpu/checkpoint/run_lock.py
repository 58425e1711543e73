"""One run per save directory: `<save-dir>/.run.lock`, held for the run's life by the process that starts it.

The lock is an flock on that file, so the kernel releases it when its process ends however it ends (kill -9
included): a crashed run never leaves it stuck. The file names the holder (pid, host, start time) for the refusal
of a second run. Where the file system does not share flocks between hosts, a holder on another host is known by
the file's time, which the holder renews every HEARTBEAT_S seconds: a lock of another host left unrenewed for
STALE_S is stale and taken over. The processes the holder starts (a launch's workers) inherit HELD and take none.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from multigpu.core.errors import UsageError

LOCK = ".run.lock"
HELD = "MULTIGPU_RUN_LOCK"  # the save directory (resolved) a process above this one holds
HEARTBEAT_S, STALE_S = 30.0, 120.0


def _holder(text: str) -> tuple[str, str, str] | None:
    """(pid, host, start time) from a lock file's text, or None for an empty or foreign one."""
    parts = text.split("\n")[:3]
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 and all(parts) else None


def _refusal(directory: Path, holder: tuple[str, str, str] | None, renewed: str = "") -> UsageError:
    pid, host, started = holder or ("unknown", "unknown", "an unknown time")
    return UsageError(
        f"--save-dir {directory} is in use by another run (pid {pid} on host {host}, started {started}{renewed}); "
        f"wait for it to end or stop it, remove {directory / LOCK} if that run is gone, or choose another --save-dir."
    )


def _check_elsewhere(file: Path, holder: tuple[str, str, str] | None) -> None:
    """Refuses where `holder` is a run on another host whose lock is still renewed (its flock may not reach us),
    or whose time lies further ahead than a renewal can: the two hosts' clocks disagree, and the lock would block
    the directory until that time has passed."""
    if holder is None or holder[1] == socket.gethostname():
        return  # on this host the flock decides: a live holder would hold it
    age = time.time() - file.stat().st_mtime
    if age < -STALE_S:
        raise _refusal(file.parent, holder, f", its lock dated {-age:.0f} s ahead of this host's clock")
    if age < STALE_S:
        raise _refusal(file.parent, holder, f", its lock renewed {max(age, 0):.0f} s ago")


@contextlib.contextmanager
def holding(save_dir: str | Path) -> Iterator[None]:
    """Holds `save_dir`'s lock while the block runs (a no-op under a process that holds it already); refuses,
    with one sentence naming the other run, a directory another live run holds. The lock file is removed as the
    block ends, however it ends (kill -9 leaves it, unlocked: the next run takes it over)."""
    directory = Path(save_dir)
    if os.environ.get(HELD) == str(directory.resolve()):
        yield
        return
    file = directory / LOCK
    fd = _locked(directory, file)
    try:
        holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        _check_elsewhere(file, holder)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{socket.gethostname()}\n{started}\n".encode(), 0)
        try:
            with _renewed(file), _inherited(directory):
                yield
        finally:
            with contextlib.suppress(OSError):
                file.unlink()  # while still locked: a run waiting on this file opens the next one (_locked)
    finally:
        os.close(fd)  # releases the flock


def _locked(directory: Path, file: Path) -> int:
    """An open descriptor of `file` holding its flock; refuses where another process holds it."""
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        except IsADirectoryError:
            raise UsageError(
                f"--save-dir {directory} has a directory named {LOCK}, where a run keeps its lock file; remove "
                f"{file}, or choose another --save-dir."
            ) from None
        except OSError as error:
            raise UsageError(
                f"--save-dir {directory} is not writable ({error.strerror}); choose a directory you can write to, "
                "or fix its permissions."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise _refusal(directory, holder) from None
        # The holder removes the file before it unlocks: a lock got on a removed file is no lock; open anew.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(file).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


@contextlib.contextmanager
def _renewed(file: Path) -> Iterator[None]:
    """Touches `file` every HEARTBEAT_S seconds while the block runs: another host tells a live lock by it."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(file)

    thread = threading.Thread(target=renew, name="multigpu-run-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


@contextlib.contextmanager
def _inherited(directory: Path) -> Iterator[None]:
    """Tells the processes started in the block (a launch's workers) that the lock is held for them."""
    before = os.environ.get(HELD)
    os.environ[HELD] = str(directory.resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HELD, None)
        else:
            os.environ[HELD] = before
