"""A test's command whose workers are forked, not started: in the process tests/dist.py's `multigpu(...)` forks for
a command, torch elastic's start of each worker (`python -u -m multigpu.launch.worker ...`, or verify's and
bench's `python -u -m multigpu.tools.harness ...`) becomes a fork of a process that has already imported what
a worker imports (torch, transformers, peft), as the command's own process has. A fresh worker spends 2-6
CPU-seconds on those imports before its script's first line (measured: a small finetune's workers 9 CPU-seconds
each, 6 of them imports), and the suite starts hundreds of workers.

The command's process forks, before its CLI runs, a server that only forks workers: single-threaded, as a process
one forks from must be (the launcher runs threads by the time its workers start), and below the command, so that a
timeout that kills the command's tree kills its workers, and a worker that dies with its launcher (PR_SET_PDEATHSIG
on its parent) dies with this server, which dies with the launcher. Each worker is otherwise what Popen starts: a
session of its own, the variables, working directory, stdin, stdout and stderr torch elastic gives it, `-u`'s
unbuffered output and the interpreter's exit; the server says its exit code, which torch elastic reads through
poll and wait as from a Popen, and reaps it only once the launcher has read that code: until then it stays a zombie,
as a Popen's child does, so that a signal sent to a worker that has just ended (torch elastic's killpg of the
survivors) meets a process, not an error. What a fresh interpreter reads as it starts is the server's, which is why
tests/dist.py forks only commands whose variables are read later.
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

from multigpu.core.child_processes import die_with_parent


def fork_workers() -> None:
    """In a command's process, before its CLI runs: starts the server its workers fork from, and has torch elastic
    ask it for each worker that would run `python -u -m MODULE ...` (anything else starts as before)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:
        ours.close()
        try:
            _serve(theirs)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)  # not the command's exit handlers: they are its process's
    theirs.close()
    server = WorkerServer(ours)
    popen = subprocess_handler.SubprocessHandler._popen

    def fork_or_popen(handler: subprocess_handler.SubprocessHandler, args: tuple, env: dict[str, str]) -> object:
        if len(args) < 4 or list(args[:3]) != [sys.executable, "-u", "-m"]:
            return popen(handler, args, env)
        # stdin, stdout and stderr as Popen gives them: the launcher's, where torch elastic opened no file.
        streams = [None, handler._stdout, handler._stderr]
        fds = [stream.fileno() if stream else default for default, stream in enumerate(streams)]
        return ForkedWorker(server, [str(arg) for arg in args], env, fds)

    subprocess_handler.SubprocessHandler._popen = fork_or_popen


class WorkerServer:
    """The launcher's side of the server: asks it for a worker, and keeps the exit codes it reports."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()  # the agent's thread and multigpu's watchers may ask at once

    def start(self, argv: list[str], env: dict[str, str], fds: list[int]) -> int:
        """Forks a worker that runs argv (`python -u -m MODULE ARGS`) as the interpreter would: its pid."""
        with self.lock:
            socket.send_fds(self.channel, [pickle.dumps(("start", argv[3], argv[4:], env, os.getcwd()))], fds)
            while (message := self._receive())[0] != "started":
                pass
            return message[1]

    def returncode(self, pid: int, wait: float = 0.0) -> int | None:
        """The worker's exit code, as Popen's returncode has it; None while it runs (waiting up to `wait` s)."""
        with self.lock:
            while pid not in self.exits and select.select([self.channel], [], [], wait)[0]:
                self._receive()
            return self.exits.get(pid)

    def _receive(self) -> tuple[str, int, int | None]:
        message = pickle.loads(self.channel.recv(4096))
        if message[0] == "exited":
            self.exits[message[1]] = message[2]
            self.channel.send(pickle.dumps(("reap", message[1])))  # read: the zombie can go, as Popen's would
        return message


class ForkedWorker:
    """What torch elastic uses of a worker's Popen (pid, poll, wait), and the rest of Popen's signalling."""

    def __init__(self, server: WorkerServer, args: list[str], env: dict[str, str], fds: list[int]) -> None:
        self.server, self.args, self.returncode = server, args, None
        self.pid = server.start(args, env, fds)

    def poll(self, wait: float = 0.0) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, wait)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll(0.05) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve(channel: socket.socket) -> None:
    """The server: forks a worker for each request and says when each ends, until the launcher's process ends."""
    die_with_parent()  # the command's process (its main thread forked this one)
    running: set[int] = set()
    while True:
        if select.select([channel], [], [], 0.05)[0]:
            message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 3)
            if not message:
                return  # the command's process ended
            request, *details = pickle.loads(message)
            if request == "reap":
                os.waitpid(details[0], 0)
            else:
                running.add(pid := _fork_worker(channel, *details, fds))
                channel.send(pickle.dumps(("started", pid, None)))
        for pid in list(running):
            # WNOWAIT: the worker stays a zombie until the launcher has read its code (the "reap" request above).
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if ended is not None:
                running.remove(pid)
                code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
                channel.send(pickle.dumps(("exited", pid, code)))


def _fork_worker(
    channel: socket.socket, module: str, args: list[str], env: dict[str, str], cwd: str, fds: list[int]
) -> int:
    """Forks one worker; returns once it leads a session of its own (torch elastic signals the session)."""
    ready, led = os.pipe()
    pid = os.fork()
    if pid == 0:
        channel.close()
        os.close(ready)
        os.setsid()
        os.close(led)
        exit_as_python(lambda: _run_worker(module, args, env, cwd, fds))
    os.close(led)
    os.read(ready, 1)  # end of file once the worker closed `led`, after setsid
    os.close(ready)
    for fd in fds:
        os.close(fd)
    return pid


def _run_worker(module: str, args: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
    """In the forked worker: what `python -u -m MODULE ARGS` does after its imports."""
    for stream, fd in enumerate(fds):
        os.dup2(fd, stream)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    unbuffered()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, cwd)  # `python -m` puts the working directory first
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # imported in the server, maybe; `python -m` runs it as __main__ alone
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def unbuffered() -> None:
    """stdout and stderr unbuffered, as `-u` and PYTHONUNBUFFERED make them: lines in the order they were written."""
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    stderr = io.FileIO(2, "w", closefd=False)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(stderr, errors="backslashreplace", write_through=True)


def exit_as_python(main: Callable[[], object]) -> NoReturn:
    """Runs `main` in a forked process and ends the process as the interpreter ends after a script: the exit code
    of a SystemExit, or a traceback and 1; exit handlers run; never returns into the frames it was forked in."""
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # what the interpreter prints of an exception nothing caught
        traceback.print_exc()
        code = 1
    if not isinstance(code, int):  # sys.exit("message") prints it and exits 1, as the interpreter does
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    os._exit(code)
