"""What a process started by `multigpu run` leaves for its launcher: small files in a folder the launcher names.

The launcher reads them once its workers have ended, to say in one place what happened: which rank failed first
(each worker's exit time and code), the newest complete checkpoint, and the sentence of a UsageError a script
raised (printed once by the launcher instead of once per rank, with a traceback each).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import astuple, dataclass
from typing import Any

#: Set by `multigpu run` for its own workers (not a user setting): a directory where they leave notes for it.
LAUNCHER_DIR = "MULTIGPU_EXIT_DIR"
LAST_CHECKPOINT = "last-checkpoint"  # the note naming the newest complete checkpoint
USAGE_ERROR = "usage-error-rank"  # + the rank: the sentence of the UsageError that ended that rank's script
DIVERGED = "diverged"  # the sentence that says the ranks went different ways (multigpu.observers.divergence)
SAID = "said-rank"  # + the rank: the one sentence that ended that rank's script, for the launcher to print once
LOST_PEER = "lost-peer-rank"  # + the rank: its script failed because a peer went away (an echo, not a cause)
STACKS = "stacks-rank"  # + the rank: its threads' Python stacks, written on the launcher's request after its script
#: Set by `multigpu run` on one node: `host:port` of the store its own process serves (torch elastic's rendezvous
#: store), which outlives every worker; the workers' heartbeats post there rather than to rank 0's store.
LAUNCHER_STORE = "MULTIGPU_LAUNCHER_STORE"


def attempt() -> int:
    """Which start of the workers this process is: 0 at first, then one more at each restart (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def launcher_store_address() -> str | None:
    """`host:port` of the store this worker's launcher serves, or None outside `multigpu run` on one node (a
    process a script or test starts of its own may inherit the variable from a launch long gone)."""
    return os.environ.get(LAUNCHER_STORE) if launched() else None


def launcher_store() -> Any:
    """A client of the store this worker's launcher serves, or None (launcher_store_address)."""
    address = launcher_store_address()
    if not address:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))


def launched() -> bool:
    """Whether this process is a worker of `multigpu run`, which reports for it."""
    folder = os.environ.get(LAUNCHER_DIR)
    return bool(folder) and os.path.isdir(folder) and "RANK" in os.environ


def note_for_launcher(name: str, text: str, folder: str | os.PathLike | None = None) -> None:
    """Leaves `text` under `name` in the launcher's `folder` (default: this worker's; nothing when not started by
    `multigpu run`); written whole."""
    folder = folder if folder is not None else os.environ.get(LAUNCHER_DIR)
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


@dataclass(frozen=True)
class ScriptEnd:
    """How a rank's script ended, noted as `rank<R>`: when (ns), its exit code, the process and its attempt (a
    restart is another), and the main thread's id (as Python's stack dumps name threads)."""

    rank: int
    stamp_ns: int
    code: int
    pid: int
    attempt: int
    main_thread: int

    @classmethod
    def now(cls, code: int) -> ScriptEnd:
        rank = int(os.environ["RANK"])
        return cls(rank, time.time_ns(), code, os.getpid(), attempt(), threading.main_thread().ident)

    def note(self, folder: str | os.PathLike | None = None) -> None:
        note_for_launcher(f"rank{self.rank}", " ".join(map(str, astuple(self)[1:])), folder)

    @classmethod
    def read(cls, folder: str | os.PathLike, rank: int) -> ScriptEnd | None:
        text = launcher_note(folder, f"rank{rank}")
        return None if text is None else cls(rank, *map(int, text.split()))
