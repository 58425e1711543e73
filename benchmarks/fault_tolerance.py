"""Time lost per failure: in place (torchft's replica groups) against restart from a checkpoint, measured.

    python benchmarks/fault_tolerance.py [--steps 30] [--kill-step 8] [--save-every 5] [--repeat 1]

Each way trains the tiny Llama (`multigpu finetune --model tiny --method full`, ddp, 8 sequences a step) for the
same --steps twice: once without a fault, once with one failure after optimizer step --kill-step (MULTIGPU_FAULT,
the test-only fault injection, on the run's first attempt only):

- **in place**: `--nproc 1 --replica-groups 2 --fault-tolerance --max-restarts 3`, two replica groups of one
  process each and a lighthouse, on this machine. Replica group 1's worker is SIGKILLed
  (`kill,step=K,group=1`); its launcher restarts it, it heals from group 0 over the network and rejoins, while
  group 0 waits out the lighthouse's heartbeat timeout and trains on alone.
- **restart from a checkpoint**: `--nproc 2 --max-restarts 1 --save-every S`. Rank 1 raises (`crash,step=K,rank=1`);
  every worker stops, all restart, resume from the last checkpoint and run again the steps since it.

Reported per run: the wall time (the command's, start to exit, from this process's clock), and the time lost per
failure, wall(failure) - wall(fault-free), for each way. For in place, from the failure run: the survivor's longest
step (its wait for the heartbeat timeout is in it) against the fault-free run's median step, the steps trained by
fewer groups (metrics.jsonl's rows with replicas < 2), and the restarted group's time to rejoin (from group 0's line
for step K to group 1's line saying it healed). For restart: the steps run again (K minus the step it resumed at)
and the restart (from the first line for step K to the line saying it resumed: processes started, model built,
checkpoint loaded), and the time until it was back past step K. Beside the wall difference, each way's loss on the
failure run's own clock, which noise between two runs on a shared machine leaves out: for restart, the time between
its two lines for step K (the same progress at both); for in place, the survivor's steps trained by fewer groups
less as many of its steps with both. Each figure is from the run of median wall time among --repeat; --keep DIR
keeps every run's directory and its timed output. The final validation loss of every failure run must equal its
way's fault-free run's (within 1e-5): a run that does not is reported as WRONG and the script exits with status 1.

The processes of a run share this machine's cores, so keep it otherwise idle; the load average is printed with each
run (a loaded machine moves the step times, so the lost seconds with them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

RUN_TIMEOUT_S = 900  # one run, start to exit; a hung run ends here
TOLERANCE = 1e-5  # |val_loss(failure) - val_loss(fault-free)|
RECIPE = ["finetune", "--model", "tiny", "--method", "full", "--multi-gpu", "ddp", "--log-every", "1"]
WAYS = ("in place", "restart")
STEP_LINE = re.compile(r"(?:\[group (\d+)\] )?step (\d+)  ")  # the progress line each logged step prints
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")
HEALED = re.compile(r"\[group 1\] .*healed from a live replica group")
VALIDATED = re.compile(r"step \d+: validation loss")


def way_args(way: str, steps: int, save_every: int) -> list[str]:
    if way == "in place":
        return ["--nproc", "1", "--replica-groups", "2", "--fault-tolerance", "--max-restarts", "3"]
    return ["--nproc", "2", "--max-restarts", "1", "--save-every", str(save_every)]


def fault(way: str, kill_step: int) -> str:
    return f"kill,step={kill_step},group=1" if way == "in place" else f"crash,step={kill_step},rank=1"


class Run(NamedTuple):
    """One run: its wall time, metrics.jsonl's step rows, its final validation loss, each output line with the
    seconds since the start at which it arrived, and the load average before and after it."""

    way: str
    failure: bool
    wall: float
    rows: list[dict]
    val_loss: float
    lines: list[tuple[float, str]]
    load: tuple[float, float] = (0.0, 0.0)

    def median_step(self) -> float:
        return statistics.median(row["perf/step_time_s"] for row in self.rows)

    def first(self, pattern: re.Pattern[str], after: float = -1.0) -> tuple[float, re.Match[str]] | None:
        """The first line after `after` seconds that matches `pattern`: its time and match."""
        for at, line in self.lines:
            match = pattern.search(line)
            if at > after and match:
                return at, match
        return None

    def step_line(self, step: int, group: str | None, after: float = -1.0) -> float | None:
        """When the progress line for `step` arrived (of replica group `group`, where the groups prefix theirs)."""
        for at, line in self.lines:
            match = STEP_LINE.search(line)
            if at > after and match and int(match.group(2)) == step and match.group(1) == group:
                return at
        return None


def run(way: str, failure: bool, options: argparse.Namespace, workdir: Path) -> Run:
    save = Path(tempfile.mkdtemp(prefix=f"{way.replace(' ', '-')}-{'fault' if failure else 'free'}-", dir=workdir))
    command = [sys.executable, "-u", "-m", "multigpu", *RECIPE, "--max-steps", str(options.steps)]
    command += [*way_args(way, options.steps, options.save_every), "--save-dir", str(save), "--resume", "none"]
    env = {key: value for key, value in os.environ.items() if key != "MULTIGPU_FAULT"}
    if failure:
        env["MULTIGPU_FAULT"] = fault(way, options.kill_step)
    env["PYTHONUNBUFFERED"] = "1"
    before = os.getloadavg()[0]
    lines: list[tuple[float, str]] = []
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    deadline = started + RUN_TIMEOUT_S
    for line in process.stdout:  # timed as each line arrives
        lines.append((time.perf_counter() - started, line.rstrip("\n")))
        if time.perf_counter() > deadline:
            process.kill()
            break
    code = process.wait()
    wall = time.perf_counter() - started
    (save.parent / f"{save.name}.log").write_text("\n".join(f"{at:9.3f} {line}" for at, line in lines) + "\n")
    if code:
        tail = "\n".join(line for _, line in lines[-40:])
        raise SystemExit(f"{' '.join(command)} (MULTIGPU_FAULT={env.get('MULTIGPU_FAULT')}) exited {code}:\n{tail}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val_loss = next(record["val_loss"] for record in reversed(records) if "val_loss" in record)
    rows = [record for record in records if "perf/step_time_s" in record]
    result = Run(way, failure, wall, rows, val_loss, lines, (before, os.getloadavg()[0]))
    label = f"{way}, {'one failure' if failure else 'fault-free'}"
    print(f"  {label}: {wall:.1f} s, val_loss {val_loss:.6f}, load average {before:.2f} -> {result.load[1]:.2f}")
    return result


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda one: one.wall)[len(runs) // 2]


def in_place_lost(failed: Run) -> float:
    """The survivor's own clock: its steps trained by fewer groups, less as many of its steps with both groups (the
    failure run's median, taken under the same load): the heartbeat wait and the slower steps alone."""
    both = [row["perf/step_time_s"] for row in failed.rows if row.get("replicas", 2) >= 2]
    fewer = [row["perf/step_time_s"] for row in failed.rows if row.get("replicas", 2) < 2]
    return sum(fewer) - len(fewer) * statistics.median(both)


def restart_lost(failed: Run, kill_step: int) -> float | None:
    """The run's own clock: from its first line for step K to its second, after the restart (the same progress at
    both, so all of it lost)."""
    crashed = failed.step_line(kill_step, None)
    back = failed.step_line(kill_step, None, after=crashed) if crashed is not None else None
    return back - crashed if crashed is not None and back is not None else None


def in_place_figures(free: Run, failed: Run, kill_step: int) -> list[str]:
    fewer = [row["step"] for row in failed.rows if row.get("replicas", 2) < 2]
    longest = max(failed.rows, key=lambda row: row["perf/step_time_s"])
    away = sum(row["perf/step_time_s"] for row in failed.rows if row.get("replicas", 2) < 2)
    both = statistics.median(row["perf/step_time_s"] for row in failed.rows if row.get("replicas", 2) >= 2)
    killed = failed.step_line(kill_step, "0")
    healed = failed.first(HEALED, after=killed if killed is not None else -1.0)
    rejoin = f"{healed[0] - killed:.1f} s" if killed is not None and healed else "not seen in the output"
    span = f"steps {fewer[0]}-{fewer[-1]}" if fewer else "none"
    reruns = failed.rows[-1].get("reruns", 0) if failed.rows else 0
    return [
        f"survivor's longest step: {longest['perf/step_time_s']:.1f} s (step {longest['step']}; median step "
        f"{free.median_step():.2f} s fault-free, {both:.2f} s with both groups in the failure run)",
        f"steps trained by fewer groups (replicas < 2): {len(fewer)} ({span}), {away:.1f} s of steps; "
        f"steps run again (reruns): {reruns}",
        f"group 1's time to rejoin, from group 0's step {kill_step} to group 1 healed: {rejoin}",
        f"lost by the survivor's own clock: {in_place_lost(failed):.1f} s (its steps by fewer groups, less as many "
        "of its steps with both)",
    ]


def restart_figures(free: Run, failed: Run, kill_step: int) -> list[str]:
    crashed = failed.step_line(kill_step, None)
    resumed = failed.first(RESUMED, after=crashed if crashed is not None else -1.0)
    if crashed is None or resumed is None:
        return ["restart: no line saying it resumed from a checkpoint after the failure (see the run's log)"]
    at_step = int(resumed[1].group(1))
    validated = failed.first(VALIDATED, after=resumed[0])
    back = failed.step_line(kill_step, None, after=resumed[0])
    figures = [
        f"steps run again: {kill_step - at_step} (failed after step {kill_step}, resumed at step {at_step})",
        f"restart, from step {kill_step}'s line to the line saying it resumed (processes started, model built, "
        f"checkpoint loaded): {resumed[0] - crashed:.1f} s",
    ]
    if validated is not None:
        figures.append(f"the validation a resumed run starts with: {validated[0] - resumed[0]:.1f} s")
    if back is not None:
        since = validated[0] if validated is not None else resumed[0]
        figures.append(f"steps {at_step + 1}-{kill_step} run again: {back - since:.1f} s")
        figures.append(f"lost by the run's own clock, step {kill_step}'s line to its next: {back - crashed:.1f} s")
    figures.append(f"median step {free.median_step():.2f} s fault-free, {failed.median_step():.2f} s with the failure")
    return figures


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as info:  # Linux: the CPU's name
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    import torch

    try:
        from importlib.metadata import version

        torchft = version("torchft")
    except Exception:
        torchft = "not installed"
    return f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, torchft {torchft}, gloo"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of every run")
    parser.add_argument("--kill-step", type=int, default=8, help="the failure comes after this optimizer step")
    parser.add_argument("--save-every", type=int, default=5, help="restart from a checkpoint: checkpoint every N")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each kind; the median run's figures")
    parser.add_argument("--keep", type=Path, help="keep every run's directory and output log here (default: none)")
    options = parser.parse_args(argv)
    if not 0 < options.kill_step < options.steps:
        parser.error("--kill-step must fall inside the run (0 < kill step < --steps)")
    print(f"machine: {machine()}; load average at the start {os.getloadavg()[0]:.2f}")
    started = time.perf_counter()
    runs: dict[tuple[str, bool], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="fault-tolerance-") as scratch:
        workdir = options.keep or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(options.repeat):
            for way in WAYS:
                for failure in (False, True):
                    runs.setdefault((way, failure), []).append(run(way, failure, options, workdir))
    wrong = []
    for way in WAYS:
        reference = median_run(runs[(way, False)]).val_loss
        for each in runs[(way, True)] + runs[(way, False)]:
            if abs(each.val_loss - reference) > TOLERANCE:
                wrong.append(f"{way}: val_loss {each.val_loss!r} against the fault-free {reference!r}")
    kill, steps = options.kill_step, options.steps
    print(f"\n{steps} steps, one failure after step {kill}; restart checkpoints every {options.save_every} steps; "
          f"median of {options.repeat} run(s) each")  # fmt: skip
    print("| way | fault-free s | one failure s | lost per failure s | lost, the run's own clock s | "
          "val_loss fault-free | val_loss failure |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for way in WAYS:
        free, failed = median_run(runs[(way, False)]), median_run(runs[(way, True)])
        same = "" if abs(failed.val_loss - free.val_loss) <= TOLERANCE else " (WRONG)"
        own = in_place_lost(failed) if way == "in place" else restart_lost(failed, kill)
        own_text = "-" if own is None else f"{own:.1f}"
        print(f"| {way} | {free.wall:.1f} | {failed.wall:.1f} | {failed.wall - free.wall:.1f} | {own_text} | "
              f"{free.val_loss:.6f} | {failed.val_loss:.6f}{same} |")  # fmt: skip
    for way, figures in (("in place", in_place_figures), ("restart", restart_figures)):
        print(f"\n{way}:")
        for line in figures(median_run(runs[(way, False)]), median_run(runs[(way, True)]), kill):
            print(f"- {line}")
    loads = [load for each in runs.values() for one in each for load in one.load]
    print(f"\nload average (1 min) during the runs: {min(loads):.2f} to {max(loads):.2f}")
    print(f"({time.perf_counter() - started:.0f} s)")
    if wrong:
        print("\nWRONG: a failure run did not end where its fault-free run did:\n" + "\n".join(wrong))
        return 1
    print("every failure run's final val_loss matches its fault-free run's (|diff| <= 1e-5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
