"""Which rank is stuck?

gloo: each rank posts its micro-step to the process group's store; a timed-out collective reads them all and names
the ranks that fell behind, instead of gloo's bare "Timed out waiting 5000ms". A post is a round trip to the store,
so ranks post at most once a second while training. When a collective times out, every waiting rank posts its exact
micro-step and gives the others a moment to do the same before reading: the ranks still showing an older micro-step
are the ones that never arrived.

NCCL: collectives are queued on the GPU and the Python call returns at once, so a waiting rank never raises where
the heartbeat could see it. NCCL's watchdog thread sees the timeout instead: `multigpu run` has it record every
rank's collectives (torch's flight recorder) and dump them when it fires, and reads the dumps to name the rank that
never reached the collective the others waited in.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

POST_INTERVAL_S = 1.0
SETTLE_S = 2.0


class CollectiveTimeout(RuntimeError):
    """A collective waited past the process-group timeout; the message names the ranks that never came."""


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class Progress:
    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.micro_step = 0
        self._store = None
        self._posted_at = float("-inf")

    def _key(self, rank: int) -> str:
        return f"multigpu/progress/{rank}"

    def _the_store(self) -> dist.Store | None:
        if self._store is None and dist.is_available() and dist.is_initialized() and self.world_size > 1:
            # The default group's store (torchrun's, or the one init_process_group made): private, but stable.
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def advance(self) -> None:
        self.micro_step += 1
        now = time.monotonic()
        if now - self._posted_at >= POST_INTERVAL_S:
            self._post()
            self._posted_at = now

    def _post(self) -> None:
        store = self._the_store()
        if store is not None:
            store.set(self._key(self.rank), str(self.micro_step))

    @contextlib.contextmanager
    def diagnose(self, op: str) -> Iterator[None]:
        try:
            yield
        except CollectiveTimeout:
            raise
        except RuntimeError as error:
            if self._the_store() is None or not _is_timeout(error):
                raise
            raise CollectiveTimeout(self.explain(op)) from error

    def explain(self, op: str) -> str:
        store = self._the_store()
        self._post()
        time.sleep(SETTLE_S)  # the other waiting ranks time out within moments and post theirs
        steps = {}
        for rank in range(self.world_size):
            key = self._key(rank)
            steps[rank] = int(store.get(key)) if store.check([key]) else 0
        behind = sorted(rank for rank, step in steps.items() if step < self.micro_step)
        where = f"{op} on rank {self.rank} at micro-step {self.micro_step}"
        if not behind:
            return (
                f"A collective in {where} timed out after {self.timeout_s:g}s although every rank reached this "
                "micro-step; some rank is inside a different collective (a rank-only branch around a collective?)."
            )
        lagging = ", ".join(f"rank {rank} (last seen at micro-step {steps[rank]})" for rank in behind)
        return (
            f"A collective in {where} timed out after {self.timeout_s:g}s: {lagging} stopped reaching collectives "
            "while the others waited; look at what that rank was doing (a hang, a deadlock, a much slower data "
            "path). The launcher stops every process."
        )


#: The file name each worker's flight recorder dumps to, in the launcher's directory; torch appends the rank.
NCCL_TRACE_PREFIX = "nccl-trace-rank"


def nccl_watchdog_environment(directory: Path) -> dict[str, str]:
    """torch's settings that make the NCCL watchdog record collectives and dump them into `directory` on a
    timeout (each under its current and its older name; torch reads one or the other)."""
    prefix = str(directory / NCCL_TRACE_PREFIX)
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


def read_nccl_traces(directory: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's recorded collectives, from the dumps our own workers wrote into our own temporary directory."""
    traces = {}
    for path in directory.glob(f"{NCCL_TRACE_PREFIX}*"):
        suffix = path.name[len(NCCL_TRACE_PREFIX) :]
        if suffix.isdigit():
            with path.open("rb") as file:
                traces[int(suffix)] = pickle.load(file).get("entries", [])
    return traces


def explain_nccl_timeout(traces: dict[int, list[dict[str, Any]]]) -> str | None:
    """The rank that never reached the collective its peers waited in, from the flight recorder's entries of this
    node's ranks; None when there is nothing to compare."""
    if len(traces) < 2:
        return None
    groups = sorted({entry["process_group"][0] for entries in traces.values() for entry in entries})
    for group in groups:
        last = {rank: _last_collective(entries, group) for rank, entries in traces.items()}
        reached = {rank: entry["collective_seq_id"] if entry else 0 for rank, entry in last.items()}
        behind = sorted(rank for rank, seq in reached.items() if seq < max(reached.values()))
        if behind:
            waiting = sorted(set(reached) - set(behind))
            awaited = _entry(traces[waiting[0]], group, min(reached[r] for r in behind) + 1)
            stopped = last[behind[0]]
            return (
                f"NCCL timed out: rank(s) {', '.join(map(str, behind))} never reached collective "
                f"{awaited['collective_seq_id']} ({awaited['profiling_name']}) of process group {group}, in which "
                f"rank(s) {', '.join(map(str, waiting))} waited; the last one they reached was "
                + (f"{stopped['collective_seq_id']} ({stopped['profiling_name']})" if stopped else "none")
                + ". Look at what those ranks did after it (a hang, a deadlock, a rank-only branch)."
            )
        unfinished = [entry for entry in last.values() if entry and entry.get("state") != "completed"]
        if unfinished:
            entry = unfinished[0]
            return (
                f"NCCL timed out: every rank entered collective {entry['collective_seq_id']} "
                f"({entry['profiling_name']}) of process group {group} and it never completed: a network, "
                "driver or GPU fault rather than a rank that stopped; run `multigpu env` to test the interconnect."
            )
    return None


def _last_collective(entries: list[dict[str, Any]], group: str) -> dict[str, Any] | None:
    mine = [e for e in entries if e["process_group"][0] == group and e.get("collective_seq_id", 0) > 0]
    return max(mine, key=lambda e: e["collective_seq_id"], default=None)


def _entry(entries: list[dict[str, Any]], group: str, seq: int) -> dict[str, Any]:
    found = [e for e in entries if e["process_group"][0] == group and e.get("collective_seq_id") == seq]
    return found[0] if found else {"collective_seq_id": seq, "profiling_name": "unknown"}
