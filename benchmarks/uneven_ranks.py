"""Two ranks of different speeds on one machine: batch shares even, auto, fixed, against the ideal.

    python benchmarks/uneven_ranks.py [--recipe train|finetune|both] [--steps N] [--repeat K]

Rank 0 runs alone on CPU 0; rank 1 runs on CPU 1 beside a co-tenant (a busy loop pinned there), so it computes at
about half speed, as a rank on a throttled or shared GPU does. Each run is the real command, `multigpu train` (the
sensor trainer) or `multigpu finetune --model tiny --method full`; once launched, each worker's threads are pinned
to its CPU by rank (what `taskset -a -p -c CPU PID` does), the launcher to both. The ideal is the sum of the two
ranks' solo speeds: one process on CPU 0, and one on CPU 1 beside the co-tenant.

Samples/s are the runs' own metrics.jsonl figures (perf/samples_per_s), over every reported interval (the steps
before auto's first change included), weighted by time; each row the median of K runs (a shared host's noise moves
one run by several percent). After the table, auto's median run against the best fixed split, and each auto run:
its changes in all and in its second half (once it should have settled), and the split it ended at. Needs 2 CPUs
and Linux; keep the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil

CPUS = (0, 1)
RECIPES = {
    "train": ["train", "--epochs", "{epochs}", "--batch-size", "32", "--mode", "conv"],
    "finetune": ["finetune", "--model", "tiny", "--method", "full", "--max-steps", "{steps}", "--seq-len", "256"],
}
FIXED = ("3,2", "2,1", "3,1")
MOVE = re.compile(r"batch_shares auto: split (\S+) from step (\d+)")


def pin_workers(root: int, stop: threading.Event) -> None:
    """Pins each worker under `root` (its RANK) to CPUS[rank], every thread, until `stop`; a lone process (no
    RANK: --nproc 1 trains in the launched process) stays where taskset put it."""
    while not stop.is_set():
        try:
            for child in psutil.Process(root).children(recursive=True):
                rank = child.environ().get("RANK")
                if rank is not None:
                    for thread in child.threads():
                        os.sched_setaffinity(thread.id, {CPUS[int(rank)]})
        except (psutil.Error, OSError):
            pass  # a process or thread that ended meanwhile
        stop.wait(0.3)


def samples_per_s(rows: list[dict]) -> float:
    """metrics.jsonl's samples/s over every reported interval, weighted by time."""
    rows = [row for row in rows if "perf/samples_per_s" in row]
    seconds = sum(row["perf/step_time_s"] for row in rows)
    return sum(row["perf/samples_per_s"] * row["perf/step_time_s"] for row in rows) / seconds


class Run(NamedTuple):
    """One run: its samples/s, batch_shares auto's changes (the step each applies from, and its split), its steps,
    and what auto said last (the split it settled on)."""

    rate: float
    moves: list[tuple[int, str]]
    steps: int
    said: str

    def settling(self) -> str:
        """How auto moved: its changes in all and in the run's second half, and the split it ended at."""
        late = sum(step > self.steps / 2 for step, _ in self.moves)
        final = self.moves[-1][1] if self.moves else "even"
        return f"{len(self.moves)} changes, {late} in the second half of its {self.steps} steps; ended at {final}"


def run(recipe: str, steps: int, nproc: int, cpus: str, shares: str | None, workdir: Path) -> Run:
    save = Path(tempfile.mkdtemp(prefix=f"{recipe}-{nproc}-{cpus}-{shares}-", dir=workdir))
    args = [part.format(steps=steps, epochs=max(1, steps // 25)) for part in RECIPES[recipe]]
    command = ["taskset", "-c", cpus, sys.executable, "-m", "multigpu", *args, "--nproc", str(nproc)]
    command += ["--save-dir", str(save), "--resume", "none", "--log-every", "5"]
    command += ["--multi-gpu", "ddp", "--batch-shares", shares] if shares else ["--multi-gpu", "single"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()
    pinning = threading.Thread(target=pin_workers, args=(process.pid, stop), daemon=True)
    pinning.start()
    output, _ = process.communicate(timeout=900)
    stop.set()
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    said = next((line for line in reversed(output.splitlines()) if "batch_shares auto" in line), "")
    moves = [(int(step), split) for split, step in MOVE.findall(output)]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return Run(samples_per_s(rows), moves, max(row.get("step", 0) for row in rows), said)


def median_run(repeat: int, *args: object) -> tuple[Run, list[Run]]:
    """The run of median samples/s among `repeat`, and all of them in the order run."""
    runs = [run(*args) for _ in range(repeat)]  # type: ignore[arg-type]
    return sorted(runs, key=lambda one: one.rate)[len(runs) // 2], runs


def measure(recipe: str, steps: int, repeat: int, workdir: Path) -> None:
    cotenant = subprocess.Popen(["taskset", "-c", str(CPUS[1]), sys.executable, "-c", "while True: pass"])
    try:
        solo = [median_run(repeat, recipe, steps, 1, str(cpu), None, workdir)[0].rate for cpu in CPUS]
        rows = [("even", median_run(repeat, recipe, steps, 2, "0,1", "even", workdir)[0])]
        auto, autos = median_run(repeat, recipe, steps, 2, "0,1", "auto", workdir)
        rows.append(("auto", auto))
        for shares in FIXED:
            rows.append((f"fixed {shares}", median_run(repeat, recipe, steps, 2, "0,1", shares, workdir)[0]))
    finally:
        cotenant.kill()
    even = rows[0][1].rate
    print(f"\n{recipe}: rank 0 alone {solo[0]:,.1f} samples/s, rank 1 beside the co-tenant {solo[1]:,.1f}")
    print("| shares | samples/s | vs even |\n| --- | ---: | ---: |")
    for name, result in rows:
        print(f"| {name} | {result.rate:,.1f} | {result.rate / even:.2f}x |")
    print(f"| ideal (sum of the solo speeds) | {sum(solo):,.1f} | {sum(solo) / even:.2f}x |")
    best = max(result.rate for name, result in rows if name.startswith("fixed"))
    print(f"auto's median run against the best fixed split: {auto.rate / best:.2f}x; {auto.said}")
    for number, each in enumerate(autos, 1):
        versus = f"{each.rate / best:.2f}x the best fixed"
        print(f"auto run {number}: {each.rate:,.1f} samples/s ({versus}), {each.settling()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=("train", "finetune", "both"), default="both")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("This benchmark pins two ranks to CPUs 0 and 1; run it on a machine with 2 or more CPUs.")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        for recipe in ("train", "finetune") if options.recipe == "both" else (options.recipe,):
            measure(recipe, options.steps, options.repeat, Path(workdir))
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
