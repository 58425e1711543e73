"""`multigpu env`: the guides' pre-flight checklist in one command.

Versions, GPUs and their memory, topology and peer access, the launcher variables that are set, and an
all-reduce smoke test in N real processes with its bandwidth. Says what it cannot check on this machine.

Run on each of several nodes (--nnodes, --node-rank, --master-addr, --master-port, as `multigpu run` takes them),
it says the interface and address this node talks to node 0 on, and its smoke test spans every node: an
all-reduce over all the processes (inter-node) and one within each node's (intra-node), each with its bus
bandwidth; node 0 lists every node. --links-out saves both links' timings over a sweep of sizes, as the JSON that
`multigpu simulate --calibration` and `--inter-calibration` read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multigpu.config.settings import Settings, setting, shown
from multigpu.core.atomic import write_file
from multigpu.core.errors import UsageError
from multigpu.core.network import Route, route_to
from multigpu.launch.launcher import LaunchConfig

VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
)
PREFIXES = ("NCCL_", "GLOO_", "SLURM_", "OMPI_COMM_WORLD_", "TORCH_DISTRIBUTED", "TORCHELASTIC_")
LINK_FILES = {"intra": "intra.json", "inter": "inter.json"}  # --links-out's files, by link
# --links-out's sweep: all-reduces from 256 KiB, x4 up to --size-mb, each size a point of the fit `multigpu simulate`
# makes. Not smaller: a switch's buffer or a shaper's bucket passes small messages faster than the link's rate, and
# the fit weighs every size alike (measured on a 100 Mbit/s shaped link: fitted from 4 KiB up, it read 163 Mbit/s;
# from 256 KiB up, 95, what TCP carries; docs/benchmarks.md, "Two nodes over links of known speed").
SWEEP_FROM, SWEEP_FACTOR = 256 * 1024, 4
ADVICE = "free some space there, or pass another --links-out"  # a disk that refuses the links


@dataclass
class EnvConfig(Settings):
    """`multigpu env`'s settings: the smoke test's, and the nodes as `multigpu run` takes them (their one
    definition is the launcher's)."""

    nproc: int = setting(2, "processes per node for the all-reduce smoke test")
    size_mb: float = setting(64, "all-reduce message size in MB")
    iterations: int = setting(10, "timed all-reduces")
    nnodes: int = shown(
        LaunchConfig, note="; run `multigpu env` on each, with its --node-rank: the smoke test spans them all"
    )
    node_rank: int = shown(LaunchConfig)
    master_addr: str = shown(LaunchConfig)
    master_port: int | None = shown(LaunchConfig)
    links_out: str | None = setting(
        None,
        "time all-reduces from 256 KiB to --size-mb and write them to DIR/intra.json (within a node) and "
        "DIR/inter.json (over every node's processes), the files `multigpu simulate --calibration` and "
        "`--inter-calibration` read; several nodes: node 0 writes them",
        metavar="DIR",
    )

    def check(self) -> None:
        if self.nproc < 1 or not 0 < self.size_mb < math.inf or self.iterations < 1:
            raise UsageError("--nproc and --iterations must be 1 or more and --size-mb a positive number.")
        if self.links_out is None:
            return
        if self.nproc == 1 and self.nnodes == 1:
            raise UsageError(
                "--links-out measures the links between processes, and one process on one node has none; pass "
                "--nproc 2 or more, or run on several nodes (--nnodes)."
            )
        if self.size_bytes < SWEEP_FACTOR * SWEEP_FROM:
            raise UsageError(
                "--links-out fits each link to all-reduces of several sizes up to --size-mb; pass --size-mb "
                f"{SWEEP_FACTOR * SWEEP_FROM / 2**20:g} or more."
            )
        if Path(self.links_out).exists() and not Path(self.links_out).is_dir():
            raise UsageError(
                f"--links-out {self.links_out} is not a directory; pass a directory for its intra.json and inter.json."
            )

    @property
    def size_bytes(self) -> int:
        """--size-mb in bytes, a whole number of float32 elements."""
        return max(4, int(self.size_mb * 2**20 / 4) * 4)

    @property
    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(**self.values_for(LaunchConfig), nproc=self.nproc)


def facts() -> tuple[list[tuple[str, str]], list[str]]:
    """(label, value) lines about this machine, and the problems found, each with its advice."""
    lines = [("python", sys.version.split()[0]), ("torch", torch.__version__)]
    problems = []
    cuda = torch.cuda.is_available()
    lines.append(("CUDA", f"{torch.version.cuda} ({torch.cuda.device_count()} GPU(s) visible)" if cuda else "no GPU"))
    lines.append(("backends", ", ".join(b for b in ("nccl", "gloo", "mpi") if getattr(dist, f"is_{b}_available")())))
    if cuda:
        lines.append(("NCCL", ".".join(map(str, torch.cuda.nccl.version()))))
        count = torch.cuda.device_count()
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            lines.append((f"GPU {index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
        if count > 1:
            peers = [
                f"{a}->{b}"
                for a in range(count)
                for b in range(count)
                if a != b and not torch.cuda.can_device_access_peer(a, b)
            ]
            lines.append(("peer access", "all pairs" if not peers else f"missing for {', '.join(peers)}"))
            if peers:
                problems.append(
                    "Some GPUs lack peer access: NCCL goes through host memory (slower); "
                    "if collectives hang, try NCCL_P2P_DISABLE=1."
                )
        if not dist.is_nccl_available():
            problems.append("This torch has no NCCL: install a CUDA build of torch to train on GPUs.")
    else:
        lines.append(("GPU checks", "skipped: no GPU here (memory, NCCL, topology and peer access need one)"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible not in (None, "") and cuda and len(visible.split(",")) > torch.cuda.device_count():
        problems.append(f"CUDA_VISIBLE_DEVICES={visible} names more GPUs than are present; fix or unset it.")
    smi = shutil.which("nvidia-smi")
    if smi:
        topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
        lines.append(("topology", topo.stdout.strip() or topo.stderr.strip()))
    else:
        lines.append(("topology", "not checked: nvidia-smi not found"))
    set_vars = {k: v for k, v in os.environ.items() if k in VARIABLES or k.startswith(PREFIXES)}
    lines.append(("variables", ", ".join(f"{k}={v}" for k, v in sorted(set_vars.items())) or "none set"))
    return lines, problems


def node_fact(config: EnvConfig, route: Route) -> str:
    """Where this node talks to node 0 from: its interface and address."""
    where = f"{route.interface} ({route.address})" if route.interface else route.address
    return (
        f"{config.node_rank} of {config.nnodes}, talks to node 0 ({config.master_addr}:{config.master_port}) on {where}"
    )


def smoke_test(config: EnvConfig) -> dict | None:
    """An all-reduce of --size-mb timed in --nproc processes on each node, by the collectives benchmark (over every
    node's processes and within each node's, on several nodes; a sweep up to it, for --links-out): what it
    measured at every size, or None if it failed."""
    from multigpu.tools.collectives import BenchmarkFailed, CollectivesConfig, run_collectives

    # warmup=0: the benchmark's first call at each size, the checked one, is the warm-up.
    sweep = {"min_bytes": smallest_size(config), "max_bytes": config.size_bytes, "factor": SWEEP_FACTOR}
    bench = CollectivesConfig(
        config.nproc, "all_reduce", **sweep, iterations=config.iterations, warmup=0, per_node=config.nnodes > 1
    )
    try:
        return run_collectives(bench, config.launch_config)
    except BenchmarkFailed:
        return None


def smallest_size(config: EnvConfig) -> int:
    """The sweep's first size: --size-mb / 4**k, the smallest not under SWEEP_FROM, so that the sweep ends at
    --size-mb itself, the size the smoke test reports; without --links-out, --size-mb alone."""
    smallest = config.size_bytes
    while config.links_out and smallest // SWEEP_FACTOR >= SWEEP_FROM:
        smallest //= SWEEP_FACTOR
    return smallest


def summary(measured: dict) -> dict:
    """The report's smoke test: the largest all-reduce over every process, and on several nodes each node's own."""
    smoke = {"backend": measured["backend"], "world": measured["world_size"], **figures(measured["results"])}
    if "nodes" in measured:
        smoke["nodes"] = [
            {key: node[key] for key in ("node", "processes", "interface", "address")} | figures(node["results"])
            for node in measured["nodes"]
        ]
        smoke["correct"] = smoke["correct"] and all(node.get("correct", True) for node in smoke["nodes"])
    return smoke


def figures(rows: list[dict]) -> dict:
    """The largest all-reduce's time and bandwidths, and whether every size was right; {} where none ran (a node
    of one process)."""
    if not rows:
        return {}
    largest = rows[-1]
    return {
        "correct": all(row["correct"] for row in rows),
        "seconds": largest["time_s"],
        "algbw_GBps": largest["algbw_GBps"],
        "busbw_GBps": largest["busbw_GBps"],
    }


def link_files(config: EnvConfig, measured: dict) -> dict[str, str]:
    """--links-out's files, written on node 0: {link: path}. On one node the whole run is within it; on several,
    the intra-node link is each size's slowest node (a step waits for it), and none is written where each node
    runs one process."""
    world, links = measured["world_size"], {}
    if config.nnodes == 1:
        links["intra"] = (world, measured["results"], f"all-reduce within one node's {world} processes")
        return write_links(Path(config.links_out), links, measured)
    within = [node["results"] for node in measured["nodes"] if node["results"]]
    if within:
        slowest = [max(rows, key=lambda row: row["time_s"]) for rows in zip(*within, strict=False)]
        links["intra"] = (
            config.nproc,
            slowest,
            f"all-reduce within each node's {config.nproc} processes (the slowest)",
        )
    links["inter"] = (world, measured["results"], f"all-reduce over all {world} processes of {config.nnodes} nodes")
    return write_links(Path(config.links_out), links, measured)


def write_links(out: Path, links: dict[str, tuple[int, list[dict], str]], measured: dict) -> dict[str, str]:
    """Each link as the JSON `multigpu bench --collectives` writes (its ranks, its timings, a note), written whole;
    {link: path}."""
    written = {}
    for link, (ranks, rows, note) in links.items():
        data = {key: measured[key] for key in ("backend", "device")}
        data |= {"world_size": ranks, "results": rows, "notes": [f"{note}, by multigpu env"]}
        text = json.dumps(data, indent=2)
        path = write_file(out / LINK_FILES[link], lambda partial, text=text: partial.write_text(text), ADVICE, False)
        written[link] = str(path)
    return written


def unfit_links(links: dict[str, str]) -> list[str]:
    """A problem for each file written that `multigpu simulate` could not fit a link to (timings too noisy to grow
    with the size), found here rather than at the simulate that reads it."""
    from multigpu.tools.simulate_request import load_calibration

    problems = []
    for link, path in links.items():
        try:
            load_calibration(path)
        except UsageError as error:
            said = str(error)
            problems.append(f"{path} fits no {link}-node link: {said[:1].lower()}{said[1:]}")
    return problems


def make_links_dir(config: EnvConfig) -> None:
    """Node 0 makes --links-out before any worker starts, so that a directory it cannot make is refused first."""
    if config.links_out is None or config.node_rank != 0:
        return
    try:
        Path(config.links_out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"--links-out {config.links_out} cannot be made ({error.strerror}); pass a directory you can write to."
        ) from None


def run(config: EnvConfig, as_json: bool) -> int:
    """`multigpu env`: the facts, the smoke test and the verdict; 1 where a problem was found."""
    lines, problems = facts()
    if config.nnodes > 1:
        lines.append(("node", node_fact(config, route_to(config.master_addr))))
    make_links_dir(config)
    measured = smoke_test(config)
    smoke = summary(measured) if measured else None
    if smoke is None:
        problems.append(smoke_failure(config))
    elif not smoke["correct"]:
        problems.append("The all-reduce returned wrong values: the interconnect or driver is faulty.")
    report: dict[str, Any] = {"facts": dict(lines), "smoke_test": smoke, "problems": problems}
    if config.links_out:
        sound = smoke is not None and smoke["correct"]  # a wrong or failed run calibrates nothing
        report["links"] = link_files(config, measured) if sound and config.node_rank == 0 else None
        problems += unfit_links(report["links"] or {})
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_report(config, report)
    return 1 if problems else 0


def smoke_failure(config: EnvConfig) -> str:
    if config.nnodes == 1:
        return (
            f"The {config.nproc}-process all-reduce failed (see above): check MASTER_ADDR/ports, firewalls, "
            "and NCCL_DEBUG=INFO output."
        )
    return (
        f"The all-reduce over {config.nnodes} nodes failed (see above): run this command on every node with the same "
        "--nnodes, --nproc, --master-addr and --master-port, and check that node 0's port is reachable (firewalls)."
    )


def print_report(config: EnvConfig, report: dict) -> None:
    lines = list(report["facts"].items())
    lines += smoke_lines(config, report["smoke_test"]) if report["smoke_test"] else []
    lines += [("links", links_line(config, report["links"]))] if "links" in report else []
    lines += [("problem", problem) for problem in report["problems"]]
    problems = len(report["problems"])
    for label, value in [*lines, ("verdict", "ready" if not problems else f"{problems} problem(s)")]:
        print(f"{label:>12}: {value}")


def speeds(figures: dict) -> str:
    return (
        f"{figures['seconds'] * 1e3:.2f} ms, algbw {figures['algbw_GBps']:.2f} GB/s, "
        f"busbw {figures['busbw_GBps']:.2f} GB/s, {'correct' if figures['correct'] else 'WRONG'}"
    )


def smoke_lines(config: EnvConfig, smoke: dict) -> list[tuple[str, str]]:
    """The smoke test's lines: on one node, the all-reduce; on several, the one over every node (inter-node), and
    within each node (intra-node): node 0 lists every node, the others their own."""
    size = f"{config.size_mb:g} MB"
    if config.nnodes == 1:
        return [("all-reduce", f"{smoke['world']} processes on {smoke['backend']}, {size}: {speeds(smoke)}")]
    where = f"{smoke['world']} processes on {config.nnodes} nodes"
    lines = [("inter-node", f"all-reduce over {where}, {smoke['backend']}, {size}: {speeds(smoke)}")]
    for node in smoke["nodes"]:
        if config.node_rank in (0, node["node"]):
            lines.append((f"node {node['node']}", node_line(node, size)))
    return lines


def node_line(node: dict, size: str) -> str:
    """A node's interface and address toward node 0, and its intra-node all-reduce."""
    place = f"{node['interface']} ({node['address']})" if node["interface"] else node["address"]
    if "seconds" not in node:
        return f"{place}; one process, so no intra-node link"
    return f"{place}; intra-node all-reduce over its {node['processes']} processes, {size}: {speeds(node)}"


def links_line(config: EnvConfig, links: dict[str, str] | None) -> str:
    if config.node_rank != 0:
        return "node 0 writes them to its --links-out"
    if links is None:
        return "not written: the smoke test failed or was wrong"
    flags = {"intra": "--calibration", "inter": "--inter-calibration"}
    use = " ".join(f"{flags[link]} {path}" for link, path in links.items())
    return f"wrote {' and '.join(links.values())}; predict with them: multigpu simulate ... {use}"
