"""What a process started by `multigpu run` leaves for its launcher: small files in a folder the launcher names.

The launcher reads them once its workers have ended, to say in one place what happened: which rank failed first
(each worker's exit time and code), the newest complete checkpoint, and the sentence of a UsageError a script
raised (printed once by the launcher instead of once per rank, with a traceback each).
"""

from __future__ import annotations

import os

#: Set by `multigpu run` for its own workers (not a user setting): a directory where they leave notes for it.
LAUNCHER_DIR = "MULTIGPU_EXIT_DIR"
LAST_CHECKPOINT = "last-checkpoint"  # the note naming the newest complete checkpoint
USAGE_ERROR = "usage-error-rank"  # + the rank: the sentence of the UsageError that ended that rank's script


def launched() -> bool:
    """Whether this process is a worker of `multigpu run`, which reports for it."""
    folder = os.environ.get(LAUNCHER_DIR)
    return bool(folder) and os.path.isdir(folder) and "RANK" in os.environ


def note_for_launcher(name: str, text: str) -> None:
    """Leaves `text` for the launcher under `name` (nothing when not started by `multigpu run`); written whole."""
    folder = os.environ.get(LAUNCHER_DIR)
    if folder and os.path.isdir(folder):
        partial = os.path.join(folder, f".{name}.{os.getpid()}")
        with open(partial, "w") as file:
            file.write(text)
        os.replace(partial, os.path.join(folder, name))


def launcher_note(folder: str | os.PathLike, name: str) -> str | None:
    """The note a worker left under `name` in `folder`, or None."""
    path = os.path.join(folder, name)
    return open(path).read() if os.path.isfile(path) else None


def usage_error_noted(folder: str | os.PathLike | None = None) -> bool:
    """Whether a rank of this run (of the launcher's `folder`, default this worker's) has left a UsageError."""
    folder = folder if folder is not None else os.environ.get(LAUNCHER_DIR)
    return bool(folder) and os.path.isdir(folder) and any(name.startswith(USAGE_ERROR) for name in os.listdir(folder))
