"""`multigpu run --replica-groups N` on one machine: a lighthouse and N replica groups started here.

Each group is an ordinary `multigpu run --replica-id I --lighthouse 127.0.0.1:PORT` in a process of its own (its
own torchrun agent, its own --max-restarts), so that one group failing, restarting and healing leaves the others
training, as the groups of a cluster do. Their output is passed through a line at a time, after `[group I] `.
This process forwards SIGINT and SIGTERM to the groups (each stops its workers and says so), waits for every one
and stops the lighthouse last. A lighthouse that dies meanwhile is the workers' to report (the Engine says it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import IO, Any

from multigpu.config.flags import config_to_argv
from multigpu.core.child_processes import die_with_parent
from multigpu.core.errors import UsageError
from multigpu.core.ports import free_port
from multigpu.launch import lighthouse
from multigpu.launch.stop import handling_stops

#: Set for the groups started here: their lighthouse ends with this process, so a run's record (config.yaml) keeps
#: --replica-groups alone, not a --replica-id and --lighthouse that would rejoin one group to a gone lighthouse.
STARTED_HERE = "MULTIGPU_REPLICA_GROUPS_HERE"
LIGHTHOUSE_START_S = 60.0  # an interpreter importing the package, on a loaded machine


def run_groups(config: Any, target: list[str], module: bool, gpus: list[str]) -> int:
    """Starts the lighthouse and the N groups of `target` (`config`: the launch's LaunchConfig; `gpus`: those the
    run may use, as CUDA_VISIBLE_DEVICES names them), waits for them; returns the run's exit code (see `run_code`);
    SIGINT or SIGTERM ends it with SystemExit 130 or 143 once every group has stopped."""
    lighthouse.require_torchft("--replica-groups")
    nproc, devices = group_devices(config, gpus)
    stops: list[int] = []
    groups: list[Child] = []
    with forwarding_stops(groups, stops), serving_lighthouse(config.min_replicas) as address:
        for index in range(config.replica_groups):
            if stops:
                break
            child = replace(config, replica_id=index, lighthouse=address, nproc=nproc, gpu_ids=None)
            groups.append(start_group(index, child, devices[index], target, module))
        codes = [group.wait() for group in groups]
    if stops:
        raise SystemExit(128 + stops[0])
    return run_code(codes)


def group_devices(config: Any, gpus: list[str]) -> tuple[int, list[str | None]]:
    """The processes of each group, and each group's CUDA_VISIBLE_DEVICES (None: as it is), from the `gpus` the run
    may use: group I takes the I-th --nproc of them (all of them each, with --share-gpus); refused where they are
    fewer than the groups' processes."""
    groups = config.replica_groups
    if not gpus:
        return config.nproc or 1, [None] * groups
    nproc = config.nproc or max(len(gpus) // groups, 1)
    if config.share_gpus:
        return nproc, [",".join(gpus)] * groups
    if nproc * groups > len(gpus):
        raise UsageError(
            f"--replica-groups {groups} of {nproc} process(es) each need {nproc * groups} GPUs and {len(gpus)} are "
            f"usable here; pass fewer --replica-groups or --nproc, or --share-gpus to share them over gloo."
        )
    return nproc, [",".join(gpus[group * nproc : (group + 1) * nproc]) for group in range(groups)]


def run_code(codes: Sequence[int]) -> int:
    """The run's exit code from its groups': 0 where one finished (a line names each that ended otherwise, after
    its restarts, while the others trained on); else the first group's that failed."""
    if all(code == 0 for code in codes):
        return 0
    failed = [f"group {group} ended with exit code {code}" for group, code in enumerate(codes) if code != 0]
    if any(code == 0 for code in codes):
        print(f"multigpu run: {', '.join(failed)} while the others finished the run.", file=sys.stderr)
        return 0
    return next(code for code in codes if code != 0)


@contextlib.contextmanager
def forwarding_stops(groups: list[Child], stops: list[int]) -> Iterator[None]:
    """Within it, SIGINT and SIGTERM go on to every group started (each in a session of its own, so a terminal's
    Ctrl-C reaches this process alone) and are noted in `stops`; the previous handlers come back after."""

    def forward(signum: int, frame: FrameType | None) -> None:
        stops.append(signum)
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                group.process.send_signal(signum)

    with handling_stops(forward):
        yield


@contextlib.contextmanager
def serving_lighthouse(min_replicas: int) -> Iterator[str]:
    """A lighthouse on a free port of this machine for the block: its `127.0.0.1:PORT`, once it answers there."""
    port = free_port()
    argv = [sys.executable, "-m", "multigpu", "lighthouse", "--port", str(port), "--bind-address", "127.0.0.1"]
    argv += ["--min-replicas", str(min_replicas)]
    # Its quorum's every change is the workers' to say; the lighthouse's own log (torchft's, in Rust) says warnings.
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    child = start(argv, env, "[lighthouse] ")
    try:
        wait_listening(child.process, port)
        yield f"127.0.0.1:{port}"
    finally:
        child.quiet = True  # its own stop line says nothing of the run
        with contextlib.suppress(ProcessLookupError):
            child.process.terminate()
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
        child.wait()


def wait_listening(process: subprocess.Popen, port: int) -> None:
    """Returns once `port` takes connections; refuses a lighthouse that ended or never listened."""
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UsageError(
                f"The replica groups' lighthouse ended with exit code {process.returncode} before it listened on "
                f"port {port}; its output above says why (run again: another free port is taken)."
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return
        time.sleep(0.1)
    raise UsageError(
        f"The replica groups' lighthouse did not listen on port {port} within {LIGHTHOUSE_START_S:.0f} s; check "
        "that `multigpu lighthouse` starts on this machine."
    )


def start_group(group: int, config: Any, devices: str | None, target: list[str], module: bool) -> Child:
    """Group `group`: `multigpu run` of `target` with this launch's settings, as one group of the lighthouse's."""
    argv = [sys.executable, "-m", "multigpu", "run", *config_to_argv(config), *(["-m"] if module else []), *target]
    # Lines reach the prefixing pump as they are written, not a buffer at a time.
    env = {**os.environ, STARTED_HERE: "1", "PYTHONUNBUFFERED": "1"}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return start(argv, env, f"[group {group}] ")


@dataclass
class Child:
    """A process started here, and the threads that pass its output through."""

    process: subprocess.Popen
    pumps: list[threading.Thread] = field(default_factory=list)
    quiet: bool = False  # set once its output no longer matters

    def wait(self) -> int:
        """Its exit code, once its output has been passed on whole."""
        code = self.process.wait()
        for thread in self.pumps:
            thread.join(timeout=5.0)  # a worker it left behind may hold the pipe: its output is not waited for
        return code


def start(argv: list[str], env: dict[str, str], prefix: str) -> Child:
    """`argv` in a session of its own (signals reach it from this process alone), dead with this process however it
    ends, its stdout and stderr passed through to this process's after `prefix`."""
    piped = subprocess.PIPE
    process = subprocess.Popen(
        argv, env=env, stdout=piped, stderr=piped, start_new_session=True, preexec_fn=die_with_parent
    )
    child = Child(process)
    for pipe, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
        thread = threading.Thread(target=pump, args=(child, pipe, out, prefix), daemon=True)
        thread.start()
        child.pumps.append(thread)
    return child


_WRITING = threading.Lock()  # one line at a time, never two groups' halves in one


def pump(child: Child, pipe: IO[bytes], out: IO[str], prefix: str) -> None:
    """Copies `pipe` to `out` a line at a time after `prefix`, until the pipe ends."""
    with pipe:
        for line in iter(pipe.readline, b""):
            if child.quiet:
                continue
            with _WRITING:
                try:
                    out.write(prefix + line.decode(errors="replace"))
                    out.flush()
                except (OSError, ValueError):  # our own output closed (`| head`): drain, or the child would block
                    child.quiet = True
