"""The one helper that runs test code in N real processes, with a hard timeout.

`run_in_processes("tests.x:fn", 2, case=...)` starts 2 workers; each calls `fn(**kwargs)` and its return value
(anything picklable) comes back in a list indexed by rank. A hang is killed, process group and all, at `timeout`.
`run_reference(TARGET, ARGV)` is `multigpu run -n 2 TARGET ARGV` in such workers, for a run a test only compares
with. `multigpu(ARGS)` runs a command as a user types it (its process forked from the same server);
`refusal(ARGS)` one that must be refused before any start.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from multigpu.core.lazy import imported
from multigpu.core.ports import free_port
from tests.forked_workers import exit_as_python, fork_workers, unbuffered

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("dist_worker.py")


def run_command(
    argv: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Runs argv in `cwd` with stdout+stderr captured; kills its whole process tree if it outlives `timeout`."""
    full_env = command_env(env)
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
        except BaseException as error:
            # torchrun starts each worker in a session of its own: kill the whole tree, not only our group, or a
            # surviving worker keeps the output pipe open and this test hangs after all. On any exception, not only
            # this timeout: pytest-timeout's alarm raises inside communicate(), and Popen's exit then waited forever
            # for the command it had not killed (a hung fault-tolerance run held a suite run that way).
            kill_tree(process.pid)
            output, _ = process.communicate()
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            raise AssertionError(f"{' '.join(argv)} did not finish within {timeout}s; output:\n{output}") from None
    _log_launch(argv, time.perf_counter() - started)
    return subprocess.CompletedProcess(argv, process.returncode, output, None)


def command_env(env: dict[str, str] | None) -> dict[str, str]:
    """A command's variables: this process's, one OpenMP thread and unbuffered output as `multigpu run` gives its
    workers, then the test's own."""
    # faulthandler prints every thread's Python stack if a worker dies of a signal (SIGABRT, SIGSEGV).
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}


def _log_launch(argv: list[str], seconds: float) -> None:
    """With MULTIGPU_TEST_LAUNCHES=FILE, one line per command a test ran: its test, seconds and command (where the
    suite's time goes: each command starts processes that import torch and more)."""
    path = os.environ.get("MULTIGPU_TEST_LAUNCHES")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as log:
            log.write(f"{seconds:.2f}\t{test}\t{' '.join(argv[1:6])}\n")


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and every process below it."""
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


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


def multigpu(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`multigpu ARGS` as a user types it: the command's own process and its workers forked from the server that
    imported torch, transformers and peft once (see forked_command), where the variables the test adds are read
    after start-up."""
    if _FORKS.get_start_method() == "forkserver" and all(read_late(name) for name in env or {}):
        return forked_command(list(args), timeout=timeout, env=env, cwd=cwd)
    return run_command([sys.executable, "-m", "multigpu", *args], timeout=timeout, env=env, cwd=cwd)


def read_late(name: str) -> bool:
    """Whether a variable is read where the command's code runs, not when Python or a library the server imported
    starts (PYTHONPATH, OMP_*, CUDA_*, HF_* and the like): multigpu's own, torchrun's, Ray's and the scripts'."""
    return name.startswith(("MULTIGPU_", "RAY_", "ACCELERATE_", "GLOO_"))


def forked_command(
    args: list[str], timeout: float, env: dict[str, str] | None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`python -m multigpu ARGS` without the interpreter's start: a process forked from the server run_in_processes
    uses, which runs the CLI's main as `python -m multigpu` would (its own session, variables, working directory
    and sys.argv, output to one file, exit handlers run at the end), and whose workers are forked too, each as
    `python -u -m MODULE` would run (tests/forked_workers.py). Saves the imports each process
    pays before it does anything (torch's, and transformers' and peft's for the recipes): tests/recipes/test_train.py
    took 78 CPU-seconds instead of 150 (116 with only the command's process forked). `running`, the
    launches tests/launch/test_launch.py stops or kills, the nodes of tests/launch/test_nodes.py and a test that
    sets a variable read at start-up still start `python -m multigpu` itself, and their workers are fresh
    interpreters."""
    full_env = command_env(env)
    started = time.perf_counter()
    start_forkserver()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "output.log")
        process = _FORKS.Process(target=_command_main, args=(args, full_env, str(cwd), log))
        process.start()
        try:
            process.join(timeout)
        finally:  # a hang, or pytest-timeout's alarm inside join: the whole tree goes (see run_command)
            hung = process.exitcode is None
            if hung:
                kill_tree(process.pid)
                process.join()
        output = log.read_text() if log.exists() else ""
    if hung:
        raise AssertionError(f"multigpu {' '.join(args)} did not finish within {timeout}s; output:\n{output}")
    _log_launch(["", "multigpu", *args], time.perf_counter() - started)
    return subprocess.CompletedProcess(["multigpu", *args], process.exitcode, output, None)


def _command_main(args: list[str], env: dict[str, str], cwd: str, log: Path) -> None:
    """In the forked process: what `python -m multigpu ARGS` does after its imports, then its exit; its workers
    forked too (tests/forked_workers.py)."""
    _own_session_writing_to(log)
    fork_workers()
    unbuffered()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, cwd)  # `python -m` puts the working directory first
    sys.argv = [str(ROOT / "src" / "multigpu" / "__main__.py"), *args]
    faulthandler.enable()
    from multigpu.__main__ import main

    exit_as_python(main)


@contextlib.contextmanager
def running(*args: str) -> Iterator[subprocess.Popen]:
    """`multigpu ARGS` started in the background (its output discarded) for the block; killed, with everything it
    started, as the block ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "multigpu", *args]
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process
    finally:
        kill_tree(process.pid)
        process.wait()


def run_in_processes(
    target: str, nproc: int, timeout: float = 120, nodes: Sequence[str] = (), **kwargs: Any
) -> list[Any]:
    """Runs `module:function` in `nproc` processes of one process group; returns each rank's result, in rank order.

    The processes are forked from a server that imported torch once (multiprocessing's forkserver): a test pays for
    its own work, not for three interpreters importing torch. Each is otherwise what `multigpu run` starts: its own
    process, torchrun's variables, multigpu's worker around the call (the same exit handling), its output kept.
    `nodes`: network namespaces (tests/nodes.py), the ranks spread over them in order, node 0 the first's address:
    each rank enters its node's namespace and nothing tells it which interface to use.
    """
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "kwargs.pkl").write_bytes(pickle.dumps(kwargs))
        started, port = time.perf_counter(), free_port()
        start_forkserver()
        ranks = [
            _FORKS.Process(target=_rank_main, args=(target, folder, rank, nproc, port, tuple(nodes)))
            for rank in range(nproc)
        ]
        for process in ranks:
            process.start()
        failed = _wait(ranks, time.monotonic() + timeout)
        logs = [folder / f"rank{rank}.log" for rank in range(nproc)]
        output = "".join(f"--- rank {rank} ---\n{log.read_text()}" for rank, log in enumerate(logs) if log.exists())
        _log_launch(["", "run_in_processes", str(nproc), target], time.perf_counter() - started)
        if failed is not None:
            raise AssertionError(f"{target} in {nproc} processes {failed}:\n{output}")
        return [pickle.loads((folder / f"rank{rank}.pkl").read_bytes()) for rank in range(nproc)]


def run_each_in_processes(
    target: str, nproc: int, calls: list[dict], timeout: float = 120, nodes: Sequence[str] = ()
) -> list[list[Any]]:
    """Runs `module:function` once for each kwargs of `calls`, one after another, in one launch of `nproc`
    processes (a launch costs more than a small call); returns each rank's results, in rank then call order."""
    return run_in_processes("tests.dist:call_each", nproc, timeout=timeout, nodes=nodes, function=target, calls=calls)


def call_each(function: str, calls: list[dict]) -> list[Any]:
    """In each rank of run_each_in_processes: the `function` named ("module:name") called with each of `calls`."""
    return [imported(function)(**kwargs) for kwargs in calls]


def run_reference(target: str, argv: list[str], nproc: int = 2, timeout: float = 120) -> str:
    """`multigpu run -n NPROC TARGET ARGV` (TARGET a script's path, or a module as `-m` takes it) for a run a test
    only compares with, not the launch it tests: TARGET in the ranks of run_in_processes; what rank 0 printed. The
    same worker, ranks and sums as the launch, without its 1 + NPROC interpreters importing torch (and a
    finetune's transformers and peft): 3-5 s of a demo's launch, 7 of a small finetune's (measured)."""
    return run_in_processes("tests.dist:printed_by", nproc, timeout=timeout, entry=target, argv=argv)[0]


def printed_by(entry: str, argv: list[str]) -> str:
    """In each rank of run_reference: what `entry` (its TARGET) printed, run as `python ENTRY ARGV` (a script: its
    folder first on sys.path) or `python -m ENTRY ARGV` runs it (a module: its main, given ARGV)."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        if entry.endswith(".py"):
            sys.path.insert(0, str(Path(entry).resolve().parent))
            with mock.patch.object(sys, "argv", [entry, *argv]):
                try:
                    runpy.run_path(entry, run_name="__main__")
                except SystemExit as exit_:
                    assert exit_.code in (0, None), f"{entry} exited {exit_.code}:\n{said.getvalue()}"
        else:
            imported(f"{entry}:main")(argv)
    return said.getvalue()


def _wait(ranks: list[multiprocessing.process.BaseProcess], deadline: float) -> str | None:
    """Waits for every rank, as torchrun's agent does: the first failure ends the others. What went wrong, if any."""
    while True:
        running = [process for process in ranks if process.exitcode is None]
        failed = [process for process in ranks if process.exitcode not in (None, 0)]
        if failed or not running or time.monotonic() > deadline:
            break
        multiprocessing.connection.wait(
            [process.sentinel for process in running], min(1.0, deadline - time.monotonic())
        )
    if running and not failed:
        # A hang: each rank's Python stacks into its log first (registered in _rank_main), so the failure says where.
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGUSR2)
        time.sleep(1.0)
    for process in running:
        # Each rank leads a process group of its own: end whatever it started too (a data loader's workers).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.join()
    if failed:
        return f"failed (rank {ranks.index(failed[0])} exited {failed[0].exitcode})"
    return "did not finish within the timeout" if running else None


def _rank_main(target: str, folder: Path, rank: int, nproc: int, port: int, nodes: tuple[str, ...] = ()) -> None:
    """One rank: its output to rank<R>.log, torchrun's variables, then multigpu's worker runs tests/dist_worker.py."""
    _own_session_writing_to(folder / f"rank{rank}.log")
    per_node, master = nproc // max(1, len(nodes)), "127.0.0.1"
    if nodes:
        from tests.nodes import enter, node_address

        enter(nodes[rank // per_node])
        master = node_address(0)
    local = rank % per_node
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(per_node))
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), PYTHONFAULTHANDLER="1")
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    from multigpu.launch import worker

    with contextlib.suppress(SystemExit):
        worker.main([str(WORKER), target, str(folder)])
    atexit._run_exitfuncs()  # ends the process: the worker's last exit handler ends it without finalising


def _own_session_writing_to(log: Path) -> None:
    """In a forked process: a session of its own, as a launched process has, and stdout and stderr to `log`."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (1, 2):
        os.dup2(out, stream)


def start_forkserver() -> None:
    """Starts the server the ranks fork from, once per test process, with what `multigpu run` gives its workers:
    one OpenMP thread that sleeps when idle (read when torch loads, so set before the server imports it)."""
    # (A variable the user set wins, as it does under `multigpu run`.)
    wanted = {
        name: os.environ.get(name, value) for name, value in (("OMP_NUM_THREADS", "1"), ("OMP_WAIT_POLICY", "PASSIVE"))
    }
    with mock.patch.dict(os.environ, wanted):
        if _FORKS.get_start_method() == "forkserver":
            multiprocessing.forkserver.ensure_running()


# What every rank imports, imported once in the server.
PRELOAD = ["torch", "torch.distributed", "multigpu.launch.worker", "multigpu.engine.engine", "tests.dist"]
PRELOAD += ["multigpu.cli"]  # and what a command's own process imports (forked_command)
# ...and what a LoRA or QLoRA rank imports on top: peft (with transformers, accelerate and
# bitsandbytes) and the Llama classes take ~3.4 s of CPU in each such rank otherwise (measured), and ~10 of the suite's
# launches start them. Left out: datasets and deepspeed start a thread as they load (pyarrow's and DeepSpeed's
# jemalloc), and a server with a thread beside its own is no safe one to fork from.
HEAVY = ["peft", "transformers.models.llama.modeling_llama"]
# On a GPU machine the ranks are spawned instead: a server whose imports touched CUDA (measured on an H200: the
# preload above does) leaves its forks unable to initialise it ("Cannot re-initialize CUDA in forked subprocess").
_FORKS = multiprocessing.get_context("spawn" if torch.cuda.is_available() else "forkserver")
if not torch.cuda.is_available():
    _FORKS.set_forkserver_preload(PRELOAD + HEAVY)


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
