"""Writing a file or a directory so that it exists whole or not at all, and a disk's refusal as one sentence.

A file is written as `.<name>.partial` beside its final name, synced, and renamed; a directory is built as
`.<name>.partial/`, each file and the directory synced, and renamed (an older one at the name is moved aside as
`.<name>.replaced` and removed only once the new one is in place). So a crash, a power loss or a full disk never
leaves something half-written under the final name: checkpoints (checkpoint/), a run's final model,
adapter and merged model, `multigpu export`'s outputs and a run's config.yaml are all written this way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from multigpu.core import faults
from multigpu.core.errors import UsageError
from multigpu.core.lazy import instance_of


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def replaced_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.replaced")


def fsync(path: Path) -> None:
    """Forces `path` to disk: a file's bytes, or a directory's entries (the files created and renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and everything behind it: its cause and context, and inside DCP's CheckpointException, each failed
    rank's exception (and theirs)."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        if instance_of(current, "torch.distributed.checkpoint.api", "CheckpointException"):
            pending += [failure for failure, _trace in current.failures.values()]


# safetensors' Rust writer raises a SafetensorError whose only trace of the OS's refusal is Rust's io::Error in its
# text, "... (os error 28)": no errno attribute, no OSError behind it. Its number is read there, and only there.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def disk_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (a full disk, a file too large, a read-only or forbidden directory), if any; found
    by its type and errno, never by its text (except safetensors', which keeps the errno in its text alone)."""
    for cause in causes(error):
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause
        found = _RUST_OS_ERROR.search(str(cause)) if instance_of(cause, "safetensors", "SafetensorError") else None
        if found:
            number = int(found.group(1))
            return OSError(number, os.strerror(number))
    return None


@contextlib.contextmanager
def disk_errors_raised() -> Iterator[None]:
    """Raises a failed write as the OSError the kernel gave (a full disk, a file too large, a read-only directory).

    torch.save into a file object fails on its way out: its zip writer raises a RuntimeError ("unexpected pos")
    while the OSError that stopped it is only that RuntimeError's __context__. DCP then pickles each rank's failure
    to share it with every rank, which drops the context, so the OSError must be raised here, in the process whose
    write failed.
    """
    try:
        yield
    except Exception as error:
        cause = disk_error(error)
        if cause is None or cause is error:
            raise
        raise OSError(cause.errno, cause.strerror, cause.filename) from error


@contextlib.contextmanager
def refused_as_usage(path: Path, advice: str | None) -> Iterator[None]:
    """A disk's refusal to write `path` as one sentence ending in `advice` (None: the OSError as it is)."""
    try:
        yield
    except Exception as error:
        cause = disk_error(error)
        if cause is None or advice is None:
            raise
        raise UsageError(f"Could not write {path}: {cause.strerror or cause}; {advice}") from error


def publish(path: Path) -> None:
    """Renames the synced `.<name>.partial` to `path`, so that a crash at any moment leaves a whole one on disk:
    an older one at `path` is moved aside (`.<name>.replaced`) and removed only once the new one is in place."""
    partial, replaced = partial_path(path), replaced_path(path)
    fsync(partial)  # a directory's names; its files' bytes are synced by whoever wrote them
    if path.exists():
        shutil.rmtree(replaced, ignore_errors=True)  # left by a crash after an earlier publish of this name
        os.replace(path, replaced)
    os.replace(partial, path)
    fsync(path.parent)  # the rename itself must survive a power loss
    shutil.rmtree(replaced, ignore_errors=True)


def write_dir(path: Path, build: Callable[[Path], None], advice: str | None = None) -> Path:
    """Builds the directory `path` whole: `build(partial)` fills `.<name>.partial/` (which exists, empty), whose
    files are then synced and the directory published. On any failure nothing is left but what was at `path`
    before; a disk's refusal raises one sentence ending in `advice` (see refused_as_usage)."""
    partial = partial_path(path)
    with refused_as_usage(path, advice):
        try:
            shutil.rmtree(partial, ignore_errors=True)  # the leftovers of a write that crashed
            partial.mkdir(parents=True)
            faults.inject("result", step=-1, rank=0)
            build(partial)
            for file in sorted(partial.rglob("*")):
                if file.is_file():
                    fsync(file)
            publish(path)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # gives back what space it took
            raise
    return path


def write_file(path: Path, write: Callable[[Path], None], advice: str | None = None, result: bool = True) -> Path:
    """Writes the file `path` whole: `write(partial)` writes `.<name>.partial` beside it, which is synced and
    renamed to `path`. On any failure nothing is left but what was at `path` before; a disk's refusal raises one
    sentence ending in `advice` (see refused_as_usage). `result`: a run's result, where MULTIGPU_FAULT's
    disk-full-result fires (a run's config.yaml, written as it starts, is not one)."""
    partial = partial_path(path)
    with refused_as_usage(path, advice):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if result:
                faults.inject("result", step=-1, rank=0)
            write(partial)
            fsync(partial)
            os.replace(partial, path)
            fsync(path.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
    return path
