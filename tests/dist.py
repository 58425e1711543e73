"""The one helper that runs test code in N real processes, through `multigpu run`, with a hard timeout.

`run_in_processes("tests.x:fn", 2, case=...)` starts 2 workers; each calls `fn(**kwargs)` and its return value
(anything picklable) comes back in a list indexed by rank. A hang is killed, process group and all, at `timeout`.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("dist_worker.py")


def run_command(
    argv: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Runs argv in `cwd` with stdout+stderr captured; kills its whole process tree if it outlives `timeout`."""
    # faulthandler prints every thread's Python stack if a worker dies of a signal (SIGABRT, SIGSEGV).
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    started = time.perf_counter()
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts each worker in a session of its own: kill the whole tree, not only our group, or a
            # surviving worker keeps the output pipe open and this test hangs after all.
            for pid in [process.pid, *descendants(process.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise AssertionError(f"{' '.join(argv)} did not finish within {timeout}s; output:\n{output}") from None
    _log_launch(argv, time.perf_counter() - started)
    return subprocess.CompletedProcess(argv, process.returncode, output, None)


def _log_launch(argv: list[str], seconds: float) -> None:
    """With MULTIGPU_TEST_LAUNCHES=FILE, one line per command a test ran: its test, seconds and command (where the
    suite's time goes: each command starts processes that import torch and more)."""
    path = os.environ.get("MULTIGPU_TEST_LAUNCHES")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as log:
            log.write(f"{seconds:.2f}\t{test}\t{' '.join(argv[1:6])}\n")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children before grandchildren (read from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def multigpu(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`multigpu ARGS` as a user types it."""
    return run_command([sys.executable, "-m", "multigpu", *args], timeout=timeout, env=env)


def run_in_processes(target: str, nproc: int, timeout: float = 120, **kwargs: Any) -> list[Any]:
    """Runs `module:function` in `nproc` processes; returns each rank's result, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kwargs.pkl").write_bytes(pickle.dumps(kwargs))
        result = multigpu("run", "-n", str(nproc), str(WORKER), target, tmp, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"{target} failed in {nproc} processes (exit {result.returncode}):\n{result.stdout}")
        return [pickle.loads((Path(tmp) / f"rank{rank}.pkl").read_bytes()) for rank in range(nproc)]


def refusal(*args: str) -> str:
    """`multigpu ARGS` run in this process, where it must be refused before any worker starts (exit code 2): what it
    printed. A command that would start workers fails the test instead (every launch goes through torch_run); the
    CLI's process adds nothing a refusal depends on, so this is the command as typed, without a process's start."""
    from multigpu.cli import main
    from multigpu.launch import launcher

    def started(*_: object) -> None:
        raise AssertionError(f"multigpu {' '.join(args)} started workers")

    printed = io.StringIO()
    quiet = (contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed))
    with mock.patch.object(launcher, "torch_run", started), quiet[0], quiet[1]:
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    assert code == 2, f"multigpu {' '.join(args)} ended with {code}, not refused:\n{printed.getvalue()}"
    return printed.getvalue()
