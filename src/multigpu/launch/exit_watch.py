"""Workers whose script ended but whose process did not: found by their launcher, shown, ended, and named.

A worker ends the process itself once its exit handlers have run (multigpu.launch.worker), so a process still alive
well after its script ended is stuck in its teardown: an exit handler or a library's thread holding it. Once every
script of the node's workers has ended, the launcher gives them EXIT_GRACE_S to exit; then it asks each one still
there for its Python stacks (SIGUSR1, which the worker hands to faulthandler once its script is over: it writes
from C, so even a process stuck with the GIL held answers) and ends it with SIGKILL. The run then says which rank
was ended and where it was stuck, and ends with the scripts' own exit code: the work was done.

torch elastic counts a killed worker as failed, and with --max-restarts it would start the scripts again; the
`scripts-done` note tells restarted workers that every script already finished (`finished_already`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from multigpu.core.launcher_notes import (
    LAUNCHER_DIR,
    STACKS,
    ScriptEnd,
    attempt,
    launched,
    launcher_note,
    note_for_launcher,
)
from multigpu.launch.stop import alive

EXIT_GRACE_S = 30.0  # how long every worker of a node may take to exit once all their scripts have ended
STUCK = "stuck-rank"  # + the rank: the main thread's stack of a worker the launcher ended after its script
SCRIPTS_DONE = "scripts-done"  # every script of the run finished with exit code 0
POLL_S = 0.5


@contextlib.contextmanager
def ending_stuck_workers(exits: Path, ranks: Sequence[int], grace_s: float | None = None) -> Iterator[None]:
    """Within it, a thread ends the workers of `ranks` (this node's) that outlive their scripts by `grace_s`."""
    finished = threading.Event()
    grace = EXIT_GRACE_S if grace_s is None else grace_s
    watch = threading.Thread(target=_watch, args=(exits, ranks, grace, finished), daemon=True, name="exit-watch")
    watch.start()
    try:
        yield
    finally:
        finished.set()
        watch.join()


def _watch(exits: Path, ranks: Sequence[int], grace_s: float, finished: threading.Event) -> None:
    while not finished.wait(POLL_S):
        ends = _ended_scripts(exits, ranks, grace_s)
        stuck = [end for end in ends if alive(end.pid) and launcher_note(exits, f"{STUCK}{end.rank}") is None]
        if stuck and all(end.code == 0 for end in ends):
            note_for_launcher(SCRIPTS_DONE, str(stuck[0].attempt), exits)
        for end in stuck:
            note_for_launcher(f"{STUCK}{end.rank}", _main_stack(exits, end), exits)
            with contextlib.suppress(ProcessLookupError):
                os.kill(end.pid, signal.SIGKILL)


def _ended_scripts(exits: Path, ranks: Sequence[int], grace_s: float) -> list[ScriptEnd]:
    """How the scripts of `ranks` ended, once all of this attempt's (a restart is another) ended `grace_s` ago;
    until then, nothing."""
    ends = [ScriptEnd.read(exits, rank) for rank in ranks]
    if any(end is None for end in ends):
        return []
    attempt = max(end.attempt for end in ends)
    if any(end.attempt != attempt for end in ends):
        return []  # a restarted script still runs
    return ends if time.time_ns() - max(end.stamp_ns for end in ends) >= grace_s * 1e9 else []


def _main_stack(exits: Path, end: ScriptEnd) -> str:
    """The main thread's Python stack of the stuck worker `end`, as faulthandler writes it (empty if none came)."""
    dump = exits / f"{STACKS}{end.rank}"
    with contextlib.suppress(ProcessLookupError):
        os.kill(end.pid, signal.SIGUSR1)
    deadline, size = time.monotonic() + 2.0, -1
    while time.monotonic() < deadline:  # written by a signal handler: wait until it stops growing
        time.sleep(0.1)
        now = dump.stat().st_size if dump.exists() else 0
        if now and now == size:
            break
        size = now
    text = dump.read_text(errors="replace") if dump.exists() else ""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    main = f"0x{end.main_thread:016x}"
    return next((block for block in blocks if main in block.splitlines()[0]), "")


def stuck_lines(exits: Path) -> list[str]:
    """What the run says of each worker it ended after its script: the main thread's stack, then one line."""
    lines = []
    for rank in sorted(int(path.name.removeprefix(STUCK)) for path in exits.glob(f"{STUCK}*")):
        stack = launcher_note(exits, f"{STUCK}{rank}")
        lines += [
            *([f"worker rank {rank} was here:", stack] if stack else []),
            f"multigpu run: worker rank {rank} finished its script but had not exited {EXIT_GRACE_S:.0f} s after "
            "every worker's script had ended, stuck in its teardown; multigpu ended it.",
        ]
    return lines


def ended_after_script(exits: Path, rank: int) -> bool:
    """Whether the launcher ended worker `rank` after its script had finished with exit code 0."""
    end = ScriptEnd.read(exits, rank)
    return end is not None and end.code == 0 and launcher_note(exits, f"{STUCK}{rank}") is not None


def finished_already() -> bool:
    """In a restarted worker: whether every script of the run had already finished (its workers were ended only
    because one was stuck after its script), so that there is nothing to run again."""
    if not launched() or attempt() == 0:
        return False
    return launcher_note(os.environ[LAUNCHER_DIR], SCRIPTS_DONE) is not None
