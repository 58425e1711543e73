"""The Ray actor that runs one worker of `multigpu run --ray` (multigpu.launch.ray_cluster) as its subprocess.

Ray imports this module in every actor it starts, so it imports nothing heavy: torch (~4 s of a core) is for the
worker itself to import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from multigpu.core.launcher_notes import LAUNCHER_DIR
from multigpu.core.ports import free_port

STOP_GRACE_S = 10.0  # a stopped worker's SIGTERM, then SIGKILL


class WorkerHost:
    """One worker's actor: where it runs, then the worker itself as a subprocess, its lines read as they come."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lines: list[tuple[int, str]] = []  # (1 stdout or 2 stderr, line) not yet handed to the driver
        self.lock = threading.Lock()
        self.readers: list[threading.Thread] = []

    def place(self, cwd: str) -> dict[str, Any]:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": [str(gpu) for gpu in ray.get_gpu_ids()],
            "cwd": os.path.isdir(cwd),
            "port": free_port(),  # free on every interface: rank 0's store listens on all of them
            "pid": os.getpid(),  # its workers die with it (multigpu.launch.stop.die_with_launcher)
        }

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        Path(env[LAUNCHER_DIR]).mkdir(parents=True, exist_ok=True)  # shared by this node's workers, as torchrun's
        env = {**os.environ, **env}
        self.process = subprocess.Popen(
            [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, text=True, errors="replace",
        )  # fmt: skip
        self.readers = [
            threading.Thread(target=self._read, args=(stream, number), daemon=True)
            for number, stream in ((1, self.process.stdout), (2, self.process.stderr))
        ]
        for reader in self.readers:
            reader.start()
        return self.process.pid

    def _read(self, stream: Any, number: int) -> None:
        for line in stream:
            with self.lock:
                self.lines.append((number, line))

    def poll(self) -> tuple[list[tuple[int, str]], int | None]:
        """The lines since the last poll, and the worker's exit code once it has ended and every line is read."""
        assert self.process is not None
        code = self.process.poll()
        if code is not None:
            for reader in self.readers:
                reader.join(timeout=1.0)  # a process of its own may still hold the pipe: do not wait on it
        with self.lock:
            lines, self.lines = self.lines, []
        return lines, code

    def stop(self) -> bool:
        """Ends the worker and everything it started (SIGTERM, then SIGKILL), as torchrun ends the survivors."""
        if self.process is None or self.process.poll() is not None:
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        return True

    def notes(self, folder: str) -> dict[str, str]:
        """The notes this node's workers left (multigpu.core.launcher_notes), the folder then removed. The workers
        of one node share the folder: the host that reads it first takes every note, the others find it gone."""
        found: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):  # read and removed by another host on this node
            for path in Path(folder).glob("*"):
                if path.is_file() and not path.name.startswith("."):
                    with contextlib.suppress(OSError, UnicodeDecodeError):
                        found[path.name] = path.read_text()
        shutil.rmtree(folder, ignore_errors=True)
        return found
