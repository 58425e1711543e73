"""The NCCL side of "which rank is stuck?": torch's flight recorder, turned on by `multigpu run`, and its dumps read.

NCCL's collectives are queued on the GPU and the Python call returns at once, so a waiting rank never raises where
the heartbeat (multigpu.observers.progress) could see it. NCCL's watchdog thread sees the timeout instead: `multigpu
run` has it record every rank's collectives and dump them when it fires, and reads the dumps to name the rank that
never reached the collective the others waited in.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

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
