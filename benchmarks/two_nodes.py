"""Two nodes joined by a link of known speed: measured step times, the simulator's prediction, the physical bound.

The nodes are network namespaces on this machine (tests/nodes.py), each link shaped with tc's token bucket to the
rate asked for (100mbit, 1gbit) or left unshaped (none: veth pairs through a bridge, as fast as the kernel copies).
For each rate the script

1. calibrates the link: `python -m multigpu.tools.collectives` (what `multigpu bench --collectives` runs) launched
   across the two nodes, 1 process each; the simulator's inter-node link is fitted from those timings, as
   `multigpu simulate --inter-calibration` fits it;
2. trains the tiny Llama (3.2M parameters, 12.9 MB of fp32 gradients, most of them the tied embedding) with
   `multigpu run --nnodes 2 ... -m multigpu.recipes.finetune --model tiny --method full` under each cell (ddp,
   zero3, ddp with bf16 and with PowerSGD gradients on 1 process per node; ddp and hsdp on 2), and takes the median
   step from metrics.jsonl after the warm-up steps;
3. predicts the same cell with the simulator (compute: the 1-process step measured on one node, once per run of
   this script; the link inside a node: a 2-process calibration on one node);
4. prints the physical bound beside both: max(compute alone, the bytes each node must send per step / the link
   rate), and how much of the shorter of the two the measured step hid under the longer (the overlap reached).

The nodes share this machine's cores: with 2 processes per node, 4 processes share 2 cores, so their compute alone
is twice the 1-process step (the simulator's --compute-slots-per-node says the same). Nothing else should run
beside it; the figures say when something did.

Run: python benchmarks/two_nodes.py [--rates 100mbit,1gbit,none] [--steps 12] [--cells ...] [--out DIR] [--repeats N]
     python benchmarks/two_nodes.py --reuse   (the tables again from the runs kept in --out)
Each run is kept in OUT/run-K; the tables pool every run kept there (on a shared machine one run can be far off).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/nodes.py: the namespaces

from tests.nodes import Cluster, NodesRefused, cluster  # noqa: E402

from multigpu.parallel.compression import Compression  # noqa: E402
from multigpu.planner.links import Link  # noqa: E402
from multigpu.planner.simulate import simulate  # noqa: E402
from multigpu.planner.simulate_advice import link_advice  # noqa: E402
from multigpu.tools.simulate_request import SimulateRequest, load_calibration, resolve  # noqa: E402

TBF_RATES = {"100mbit": 100e6, "1gbit": 1e9}  # bits per second, as tc reads them
MODEL = "tiny"
# Small per-process work (2 sequences of 64 tokens) so that communication dominates on the slow links.
RECIPE = ["--model", MODEL, "--method", "full", "--seq-len", "64", "--batch-size", "2", "--log-to", "jsonl"]
RECIPE += ["--log-every", "1", "--eval-batches", "1"]
LAUNCH_TIMEOUT_S = 420  # one launch, start to exit; a hung rendezvous ends here, its processes killed
CALIBRATION = ["--ops", "all_reduce,all_gather,reduce_scatter", "--min-bytes", "4096", "--factor", "4"]
CALIBRATION += ["--iterations", "5", "--warmup", "2"]
# The links are fitted from messages of this size and up: tc's bucket lets 64 KB through at once, so smaller ones
# cross a shaped link faster than its rate, and a fit weighted by relative error (fit_link's) follows them. The runs
# move 0.2-13 MB at a time (a block's unit, the embedding, DDP's one bucket).
FIT_FROM_BYTES = 256 * 2**10


@dataclass(frozen=True)
class Cell:
    strategy: str
    per_node: int  # processes per node
    compression: str = "none"
    # The 1-process run whose step is this cell's compute alone: FSDP's (zero3) carries its copies in and out of flat
    # buffers, which a sharded cell pays at any process count; on one node hsdp is zero3 over its processes.
    alone: str = "single"
    advised: bool = False  # print what `multigpu simulate` advises a run of this cell

    @property
    def label(self) -> str:
        return self.strategy + ("" if self.compression == "none" else f" + {self.compression}")

    @property
    def key(self) -> str:
        return f"{self.strategy}:{self.compression}:{self.per_node}"


CELLS = (
    Cell("ddp", 1, advised=True),
    Cell("zero3", 1, alone="zero3"),
    Cell("ddp", 1, "bf16"),
    Cell("ddp", 1, "powersgd"),
    Cell("ddp", 2, advised=True),
    Cell("hsdp", 2, alone="zero3"),  # shards inside a node, replicas across: needs 2 processes per node
)


class Launches:
    """Every launch of this run: a fresh master port each (no waiting out TIME_WAIT), a hard timeout each."""

    def __init__(self, out: Path) -> None:
        self.out, self.ports = out, itertools.count(29650)

    def run(self, argvs: Sequence[list[str]], name: str) -> None:
        """Starts every argv at once (one per node) and waits for all; on a timeout or a failure kills every process
        group it started and raises, naming the log."""
        log = self.out / f"{name}.log"
        with log.open("w") as sink:
            procs = [
                subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True) for argv in argvs
            ]
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            try:
                codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
            except subprocess.TimeoutExpired:
                codes = None
            finally:
                for p in procs:  # each launch is its own session: its launcher, workers and ip-netns-exec
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
        if codes is None or any(codes):
            why = f"timed out after {LAUNCH_TIMEOUT_S} s" if codes is None else f"exit codes {codes}"
            raise RuntimeError(f"{name}: {why}; see {log}")

    def across(self, nodes: Cluster, per_node: int, module_args: list[str], name: str) -> None:
        """`multigpu run --nnodes N ... -m MODULE_ARGS` on every node at once."""
        port = str(next(self.ports))
        argvs = [
            node.multigpu("run", "--nnodes", str(len(nodes.nodes)), "--node-rank", str(node.index), "--master-addr",
                          nodes.master.address, "--master-port", port, "-n", str(per_node), "-m", *module_args)
            for node in nodes.nodes
        ]  # fmt: skip
        self.run(argvs, name)

    def alone(self, nodes: Cluster, nproc: int, module_args: list[str], name: str) -> None:
        """`multigpu run -n NPROC -m MODULE_ARGS` on the first node only."""
        self.run([nodes.master.multigpu("run", "-n", str(nproc), "-m", *module_args)], name)


def finetune_args(cell: Cell, steps: int, save_dir: Path) -> list[str]:
    return ["multigpu.recipes.finetune", *RECIPE, "--multi-gpu", cell.strategy, "--grad-compression",
            cell.compression, "--max-steps", str(steps), "--save-dir", str(save_dir)]  # fmt: skip


def median_step(save_dir: Path, warmup: int) -> dict[str, float]:
    """The median and spread of rank 0's step times after `warmup` steps, from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [row["perf/step_time_s"] for row in rows if "perf/step_time_s" in row and row["step"] > warmup]
    if not times:
        raise RuntimeError(f"{save_dir}/metrics.jsonl has no step after the {warmup} warm-up steps")
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": len(times)}


def measure(args: argparse.Namespace, out: Path) -> dict:
    """Runs every launch; returns (and keeps in OUT/measured.json) what was measured."""
    launches, cores = Launches(out), len(os.sched_getaffinity(0))
    measured: dict = {"cores": cores, "cpu": cpu_name(), "steps": args.steps, "warmup": args.warmup, "rates": {}}
    measured["load_before"] = os.getloadavg()[0]  # above ~0.5: something else ran on the cores these figures share
    cells = [c for c in CELLS if c.key in args.cells.split(",")] if args.cells else list(CELLS)
    with cluster(2) as nodes:
        started = time.monotonic()
        # Compute alone: one process on one node (no link), the same per-process batch; the strategies whose
        # 1-process step carries their own copies (FSDP's flat buffers) measured under themselves.
        measured["alone"] = {}
        for strategy in dict.fromkeys(cell.alone for cell in cells):
            save = out / f"alone-{strategy}"
            launches.alone(nodes, 1, finetune_args(Cell(strategy, 1), args.steps, save), f"alone-{strategy}")
            measured["alone"][strategy] = median_step(save, args.warmup)
            print(f"compute alone, {strategy}: {measured['alone'][strategy]['median_s'] * 1e3:.1f} ms", flush=True)
        # The link inside a node (hsdp's shards talk over it): 2 processes on one node, loopback.
        intra = out / "intra.json"
        launches.alone(nodes, 2, ["multigpu.tools.collectives", "--worker", str(intra), *CALIBRATION,
                                  "--max-bytes", str(16 * 2**20)], "calibrate-intra")  # fmt: skip
        for rate in args.rates.split(","):
            nodes.shape(None if rate == "none" else rate)
            here: dict = {"cells": {}}
            calibration = out / f"inter-{rate}.json"
            largest = 4 * 2**20 if rate == "100mbit" else 16 * 2**20  # 100 Mbit/s: 0.3 s a 4 MiB all-reduce
            launches.across(nodes, 1, ["multigpu.tools.collectives", "--worker", str(calibration), *CALIBRATION,
                                       "--max-bytes", str(largest)], f"calibrate-{rate}")  # fmt: skip
            for cell in cells:
                save = out / f"{rate}-{cell.key.replace(':', '-')}"
                begun = time.monotonic()
                launches.across(nodes, cell.per_node, finetune_args(cell, args.steps, save), save.name)
                here["cells"][cell.key] = median_step(save, args.warmup)
                here["cells"][cell.key]["launch_s"] = time.monotonic() - begun
                step = here["cells"][cell.key]["median_s"]
                print(f"{rate}: {cell.label} {cell.per_node}/node: {step * 1e3:.1f} ms", flush=True)
            measured["rates"][rate] = here
        measured["elapsed_s"] = time.monotonic() - started
    (out / "measured.json").write_text(json.dumps(measured, indent=2))
    return measured


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def fitted(out: Path, name: str) -> Path:
    """OUT/NAME.json's timings at FIT_FROM_BYTES and up, as a calibration file of their own (OUT/NAME-fit.json)."""
    data = json.loads((out / f"{name}.json").read_text())
    data["results"] = [row for row in data["results"] if row["bytes"] >= FIT_FROM_BYTES]
    path = out / f"{name}-fit.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def request(cell: Cell, compute_s: float, slots: int, out: Path, rate: str) -> SimulateRequest:
    from multigpu.models.lm_models import model_dir

    return SimulateRequest(
        model=str(model_dir(MODEL)),
        compute_s=compute_s,
        units_per_step=2,
        gpus=str(2 * cell.per_node),
        gpus_per_node=cell.per_node,
        strategy=cell.strategy,
        grad_compression=cell.compression,
        grad_bytes=4,
        param_bytes=4,  # fp32 training: the all-gathers move fp32 weights
        compute_slots_per_node=slots,
        calibration=str(fitted(out, "intra")),
        inter_calibration=str(fitted(out, f"inter-{rate}")),
    )


def link_rate_Bps(rate: str, out: Path) -> float:
    """The link's rate in bytes/s: tc's where it is shaped; unshaped, the all-reduce bus bandwidth measured across
    the nodes (a 2-rank ring sends each byte once over the link, so that is the rate the link carried)."""
    if rate in TBF_RATES:
        return TBF_RATES[rate] / 8
    return load_calibration(fitted(out, f"inter-{rate}"))["all_reduce"].bandwidth_Bps


def wire_seconds(cell: Cell, rate_Bps: float, out: Path) -> float:
    """The seconds the bytes each node must send per step take at the link's rate: the simulator's collectives on
    a link of that bandwidth and no latency between the nodes, and an instant one inside a node, nothing hidden."""
    config, _, _ = resolve(request(cell, 1.0, cell.per_node, out, "none"))
    config = dataclasses.replace(config, overlap=False)
    bare, instant = Link(0.0, rate_Bps), Link(0.0, 1e30)
    return simulate(config, instant, bare)[0].comm_s


def cell_figures(measured: dict, out: Path, rate: str, cell: Cell) -> dict:
    """One run's figures for one cell at one rate (seconds): measured, simulated, compute alone, the wire at the
    nominal rate and at the rate the link carried, and the flags `multigpu simulate` advised (advised cells)."""
    inter = load_calibration(fitted(out, f"inter-{rate}"))["all_reduce"]
    cores = measured["cores"]
    # Each process's compute alone: the 1-process step, stretched where the processes outnumber the cores (both
    # nodes' processes share this machine's).
    one = measured["alone"][cell.alone]["median_s"]
    slots = max(1, cores // 2)
    config, intra, inter_links = resolve(request(cell, one, slots, out, rate))
    predictions = simulate(config, intra, inter_links)
    figures = {
        "step": measured["rates"][rate]["cells"][cell.key]["median_s"],
        "simulated": predictions[0].step_s,
        "compute": one * max(1.0, cell.per_node / slots),
        "wire": wire_seconds(cell, link_rate_Bps(rate, out), out),
        "wire_carried": wire_seconds(cell, inter.bandwidth_Bps, out),
        "carried": inter.bandwidth_Bps,
    }
    if cell.advised:
        predict = lambda changed: simulate(*resolve(changed))[0]  # noqa: E731
        advice = link_advice(request(cell, one, slots, out, rate), predictions, predict) or ""
        figures["advised"] = ", ".join(re.findall(r"(--[a-z-]+ [a-z0-9]+), [0-9.]+ s", advice)) or "nothing"
    return figures


def report(runs: list[tuple[dict, Path]]) -> None:
    """The tables: per rate and cell, the median over the runs of each run's figures, and the measured range."""
    first = runs[0][0]
    loads = ", ".join(f"{m['load_before']:.2f}" for m, _ in runs if "load_before" in m)
    print(f"\n{first['cpu']}, {first['cores']} cores shared by both nodes; tiny Llama, 2 x 64 tokens per process; "
          f"median of steps {first['warmup'] + 1}-{first['steps']} in each of {len(runs)} run(s), the median over "
          f"the runs shown" + (f"; load average before each run: {loads}" if loads else ""))  # fmt: skip
    rates = [rate for rate in first["rates"] if all(rate in m["rates"] for m, _ in runs)]
    for rate in rates:
        keys = [key for key in first["rates"][rate]["cells"] if all(key in m["rates"][rate]["cells"] for m, _ in runs)]
        table = {key: [cell_figures(m, out, rate, next(c for c in CELLS if c.key == key)) for m, out in runs]
                 for key in keys}  # fmt: skip
        carried = statistics.median(f["carried"] for rows in table.values() for f in rows)
        nominal = link_rate_Bps(rate, runs[0][1]) if rate in TBF_RATES else carried
        print(f"\nlink {rate}: carries {carried * 8 / 1e6:,.0f} Mbit/s (the all-reduce fitted across the nodes); "
              f"the bound at {nominal * 8 / 1e6:,.0f} Mbit/s, and at the rate carried")  # fmt: skip
        header = ("cell", "procs", "measured", "range", "simulated", "error", "compute", "wire", "bound", "of it",
                  "carried", "of it", "overlap")  # fmt: skip
        print("{:<16} {:>5} {:>9} {:>13} {:>9} {:>6} {:>8} {:>8} {:>8} {:>6} {:>8} {:>6} {:>7}  (ms)".format(*header))
        for key, rows in table.items():
            cell = next(c for c in CELLS if c.key == key)
            f = {name: statistics.median(row[name] for row in rows) for name in rows[0] if name != "advised"}
            bound, bound_carried = max(f["compute"], f["wire"]), max(f["compute"], f["wire_carried"])
            # What the step hid at the rate the link carries: compute and the wire one after the other, less the
            # step, over the shorter of the two (0: nothing overlapped).
            hidden = (f["compute"] + f["wire_carried"] - f["step"]) / min(f["compute"], f["wire_carried"])
            spread = f"{min(r['step'] for r in rows) * 1e3:.0f}-{max(r['step'] for r in rows) * 1e3:.0f}"
            print(
                f"{cell.label:<16} {2 * cell.per_node:>5} {f['step'] * 1e3:>9.1f} {spread:>13} "
                f"{f['simulated'] * 1e3:>9.1f} {f['simulated'] / f['step'] - 1:>+6.0%} {f['compute'] * 1e3:>8.1f} "
                f"{f['wire'] * 1e3:>8.1f} {bound * 1e3:>8.1f} {f['step'] / bound:>6.0%} {bound_carried * 1e3:>8.1f} "
                f"{f['step'] / bound_carried:>6.0%} {max(0.0, hidden):>7.0%}"
            )
        for key, rows in table.items():
            if "advised" in rows[0]:
                cell = next(c for c in CELLS if c.key == key)
                advised = " | ".join(row["advised"] for row in rows)
                print(f"multigpu simulate advises ddp on 2 nodes x {cell.per_node} (each run): {advised}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit,none", help="tc rates (100mbit, 1gbit) or none")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per launch")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    parser.add_argument("--cells", default="", help=f"a subset of {','.join(c.key for c in CELLS)}")
    parser.add_argument("--out", default="bench/two-nodes", help="where each run is kept (OUT/run-1, run-2, ...)")
    parser.add_argument("--repeats", type=int, default=1, help="runs to add to OUT; the tables pool every run kept")
    parser.add_argument("--reuse", action="store_true", help="the tables from the runs kept in OUT, no launches")
    args = parser.parse_args()
    for rate in args.rates.split(","):
        if rate != "none" and rate not in TBF_RATES:
            parser.error(f"--rates takes {', '.join(TBF_RATES)} or none (got {rate!r})")
    Compression.parse("powersgd")  # the compression names the cells use exist in this version
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(0 if args.reuse else args.repeats):
        run = next(out / f"run-{i}" for i in itertools.count(1) if not (out / f"run-{i}").exists())
        run.mkdir()
        try:
            measure(args, run)
        except NodesRefused as refused:
            run.rmdir()
            sys.exit(f"two_nodes: cannot make the nodes: {refused}")
    kept = sorted(out.glob("run-*/measured.json"), key=lambda path: int(path.parent.name.split("-")[1]))
    if not kept:
        sys.exit(f"two_nodes: no run kept in {out}; run without --reuse first")
    report([(json.loads(path.read_text()), path.parent) for path in kept])


if __name__ == "__main__":
    main()
