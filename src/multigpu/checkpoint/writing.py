"""A checkpoint written whole or not at all, and a write the disk refuses said as one sentence on every rank.

It is written under `.<name>.partial` and renamed to `<name>` only when every part is synced to disk (core/atomic.py's
publish), so a crash or a power loss during a save never leaves something that resume would pick up.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
import tempfile
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from multigpu.checkpoint.files import grouped, this_rank
from multigpu.checkpoint.finding import list_checkpoints
from multigpu.core.atomic import causes, disk_error, disk_errors_raised, partial_path, publish
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.core.launcher_notes import LAST_CHECKPOINT, note_for_launcher
from multigpu.core.lazy import instance_of


@functools.cache
def synced_writer() -> type:
    """DCP's file writer (one file per rank, each synced to disk), whose failed writes raise their OSError. Made at
    the first save: importing DCP costs each process ~0.6 s of CPU, which a process that saves nothing (the CLI, the
    launcher reading its notes) need not pay."""
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Future:
            with disk_errors_raised():
                return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: list) -> None:
            with disk_errors_raised():  # .metadata, written by rank 0 alone
                super().finish(metadata, results)

    return Writer


def agree_on_failure(path: Path, failure: OSError | None) -> None:
    """Raises the same write failure on every rank if any rank had one (a collective: every rank calls it)."""
    failures = [failure]
    if grouped():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    for rank, error in enumerate(failures):
        if error is not None:
            if this_rank() == 0:
                shutil.rmtree(partial_path(path), ignore_errors=True)  # gives back what space it took
            raise write_failed(path, error, rank if grouped() else None) from error


def write_failed(path: Path, error: OSError, rank: int | None = None) -> UsageError:
    """One sentence for a checkpoint the disk refused: what happened, that the last complete one is intact."""
    where = f" on rank {rank}" if rank is not None else ""
    done = list_checkpoints(path.parent)
    kept = [p for p in done if p != path] or done
    last = f"the last complete checkpoint, {kept[-1]}, is intact" if kept else "no complete checkpoint exists yet"
    refusal = UsageError(
        f"Could not write the checkpoint {path.name} in {path.parent}{where}: {error.strerror or error}; {last}. "
        "Free space or make the directory writable (or choose another save directory), then run the same command "
        "again to resume."
    )
    refusal.on_every_rank = grouped()  # every rank raises it: DCP and agree_on_failure share each failure with all
    return refusal


def check_writable(directory: Path, flag: str, named: Path | None = None) -> None:
    """Refuses, before any training, a directory where nothing can be written (read-only, forbidden, a file).
    `named`: what the message calls `flag`'s value, where that is a file to be written in `directory`."""
    named = directory if named is None else named
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {named} cannot be created: {existing} is a file; choose another {flag}.")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".multigpu-write-test-"):
            pass
    except OSError as error:
        raise UsageError(
            f"{flag} {named} is not writable ({error.strerror} in {existing}); choose a directory you can write "
            "to, or fix its permissions."
        ) from None


_seen_shared: set[Path] = set()  # directories every rank was shown to see alike


def check_shared(directory: Path, flag: str = "the checkpoint directory") -> None:
    """Refuses, on every rank of a run over several nodes, a directory some rank does not see as rank 0 does (a
    path on each node's own disk): rank 0 writes a file there and every rank looks for it. A collective, made once
    per directory; nothing on one node, where every rank reads the same disk."""
    directory = Path(directory).resolve()
    env = DistEnv.from_environ()
    if directory in _seen_shared or not grouped() or env.world_size <= env.local_world_size:
        return
    token: list[str | None] = [None]
    if this_rank() == 0:
        with contextlib.suppress(OSError):  # then every rank refuses it below
            directory.mkdir(parents=True, exist_ok=True)
            (directory / (name := f".multigpu-shared-{uuid.uuid4().hex}")).touch()
            token = [name]
    dist.broadcast_object_list(token, src=0)
    if token[0] is None:
        raise UsageError(f"{flag} {directory} cannot be written on rank 0; choose a directory every node can write.")
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, ((directory / token[0]).exists(), socket.gethostname()))
    if this_rank() == 0:
        (directory / token[0]).unlink(missing_ok=True)
    blind = [rank for rank, (found, _) in enumerate(seen) if not found]
    if blind:
        raise UsageError(
            f"{flag} {directory} is not one directory every node shares: rank{'s' if len(blind) > 1 else ''} "
            f"{', '.join(map(str, blind))} cannot see the file rank 0 wrote there; put it on a filesystem every node "
            "mounts at the same path (NFS, Lustre, a cloud bucket's mount)."
        )
    _seen_shared.add(directory)


_last_committed: Path | None = None  # by this process, for the line a stopped run ends with
_committing: Path | None = None  # the checkpoint whose commit is under way


def last_committed() -> Path | None:
    """The checkpoint this process committed last (rank 0, or a single process), or None. A commit that a stop
    interrupted right after its rename counts: the checkpoint is complete from the rename on, even if the stop came
    before the commit recorded it."""
    if _committing is not None and _committing.is_dir():
        return _committing.resolve()
    return _last_committed


def commit(path: Path) -> None:
    """Rank 0 only, once every rank's files are written and synced: the rename that makes the checkpoint exist
    (core/atomic.py's publish: a crash at any moment leaves a complete checkpoint on disk)."""
    global _committing, _last_committed
    _committing = path
    publish(path)
    _last_committed, _committing = path.resolve(), None
    note_for_launcher(LAST_CHECKPOINT, str(_last_committed))  # named when the run is stopped or fails


def translate_write_error(path: Path, error: BaseException) -> BaseException:
    """What to raise for a failed write of the checkpoint at `path`: a disk's refusal becomes one sentence (and the
    partial directory is removed, to give back the space); anything else stays as it was."""
    cause = disk_error(error)
    if cause is None:
        return error
    if this_rank() == 0:
        shutil.rmtree(partial_path(path), ignore_errors=True)
    return write_failed(path, cause, _failed_rank(error) if grouped() else None)


def _failed_rank(error: BaseException) -> int | None:
    """The first rank whose write DCP reports as refused by the disk, if DCP reported it."""
    for current in causes(error):
        if instance_of(current, "torch.distributed.checkpoint.api", "CheckpointException"):
            refused = [rank for rank, (failure, _) in current.failures.items() if disk_error(failure) is not None]
            if refused:
                return min(refused)
    return None
