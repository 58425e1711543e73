"""`multigpu bench --collectives`: all-reduce, all-gather and reduce-scatter bandwidth, as nccl-tests reports it.

A size S is the whole buffer as nccl-tests counts it: the all-reduce tensor, the all-gather output, the reduce-scatter
input (each rank holds or receives S/n of the last two). algbw = S / time; busbw = algbw x the share of S each rank
must send, so one figure compares ops and process counts with each other and with the link's speed.

    python -m multigpu.tools.collectives [--nproc 2 --ops ... --min-bytes ...]  launches the workers, prints the tables
    python -m multigpu.tools.collectives --worker OUT.json [the same flags]    what each launched process runs

With --per-node (`multigpu env` over several nodes) each op is also timed within each node's processes, a process
group per node, and every node's interface and address toward node 0 is gathered.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from multigpu.config.flags import Parser, add_config_arguments, config_from_args, config_to_argv
from multigpu.core.env import DistEnv, init_process_group
from multigpu.core.errors import UsageError, exit_on_usage_error
from multigpu.core.network import route_to

if TYPE_CHECKING:  # the launcher is imported where a benchmark is launched, never in the workers
    from multigpu.launch.launcher import LaunchConfig

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn); torch 2.6 has only those.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
GLOO_REDUCE_SCATTER = (
    "reduce_scatter on gloo is timed as all_to_all_single plus a local sum: torch's gloo reduce-scatter runs a whole "
    "all-reduce (measured on loopback: twice the bytes), while these move the bytes of a reduce-scatter."
)


class BenchmarkFailed(RuntimeError):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code  # the failed worker's exit code


@dataclass
class CollectivesConfig:
    nproc: int = field(default=2, metadata={"help": "processes (one per GPU on a GPU machine)"})
    ops: str = field(default=",".join(OPS), metadata={"help": f"comma-separated collectives among {', '.join(OPS)}"})
    min_bytes: int = field(default=1024, metadata={"help": "smallest total buffer in bytes (nccl-tests' -b)"})
    max_bytes: int = field(default=64 * 2**20, metadata={"help": "largest total buffer in bytes (nccl-tests' -e)"})
    factor: int = field(default=4, metadata={"help": "size multiplier between points (nccl-tests' -f)"})
    iterations: int = field(default=20, metadata={"help": "timed calls per collective and size"})
    warmup: int = field(default=5, metadata={"help": "untimed calls before the timed ones"})
    json_out: str | None = field(default=None, metadata={"help": "also write the results to this JSON file"})
    per_node: bool = field(
        default=False,
        metadata={
            "help": "also time each op within each node's processes (a process group per node), and gather each "
            "node's interface and address toward node 0"
        },
    )

    def __post_init__(self) -> None:
        unknown = [op for op in self.op_list if op not in OPS]
        if unknown or not self.op_list:
            raise UsageError(f"--ops has unknown {', '.join(unknown) or 'nothing'}; choose among {', '.join(OPS)}.")
        if self.nproc < 1 or self.iterations < 1 or self.warmup < 0:
            raise UsageError("--nproc and --iterations must be 1 or more, and --warmup 0 or more.")
        if self.min_bytes < 4 or self.max_bytes < self.min_bytes:
            raise UsageError(
                f"Sizes must satisfy 4 <= --min-bytes <= --max-bytes (got {self.min_bytes} and {self.max_bytes})."
            )
        if self.factor < 2:
            raise UsageError(f"--factor must be 2 or more (got {self.factor}), so that the sizes grow.")

    @property
    def op_list(self) -> list[str]:
        return list(dict.fromkeys(op.strip() for op in self.ops.split(",") if op.strip()))


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw as nccl-tests defines it: the share of S each rank sends in a bandwidth-optimal algorithm."""
    return {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op] * (world - 1) / world


def sizes(config: CollectivesConfig, world: int) -> list[int]:
    """min_bytes, x factor, ... up to max_bytes, each rounded down to a multiple of 4 * world bytes (at least that),
    so that every rank holds a whole number of float32 elements."""
    unit, size, out = 4 * world, config.min_bytes, []
    while size <= config.max_bytes:
        out.append(max(unit, size // unit * unit))
        size *= config.factor
    return list(dict.fromkeys(out))  # rounding up to one unit can merge the smallest sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(
    op: str, total_bytes: int, device: torch.device, group: Any = None
) -> tuple[Callable[[], None], Callable[[], bool]]:
    """One call of `op` among `group`'s ranks (None: every rank) on buffers of `total_bytes` in all, and a check of
    what the first call produced."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = total_bytes // 4
    shard = count // world
    if op == "all_reduce":
        buffer = torch.ones(count, device=device)

        def check() -> bool:
            correct = bool((buffer == world).all())
            buffer.zero_()  # repeated in-place sums of ones would grow to inf
            return correct

        return lambda: dist.all_reduce(buffer, group=group), check
    if op == "all_gather":
        mine, gathered = torch.full((shard,), float(rank), device=device), torch.empty(count, device=device)
        ranks = torch.arange(world, device=device, dtype=torch.float32).unsqueeze(1)
        gather = functools.partial(ALL_GATHER, gathered, mine, group=group)
        return gather, lambda: bool((gathered.view(world, shard) == ranks).all())
    # Slot j of every rank's input holds j + 1, so rank r must receive world * (r + 1).
    full = torch.arange(1, world + 1, device=device, dtype=torch.float32).repeat_interleave(shard)
    mine = torch.empty(shard, device=device)
    if "nccl" in dist.get_backend():
        return lambda: REDUCE_SCATTER(mine, full, group=group), lambda: bool((mine == world * (rank + 1)).all())
    received = torch.empty(count, device=device)

    def all_to_all_then_sum() -> None:  # see GLOO_REDUCE_SCATTER
        dist.all_to_all_single(received, full, group=group)
        torch.sum(received.view(world, shard), dim=0, out=mine)

    return all_to_all_then_sum, lambda: bool((mine == world * (rank + 1)).all())


def measure(op: str, total_bytes: int, iterations: int, warmup: int, device: torch.device, group: Any = None) -> dict:
    """Times `op` on `total_bytes` (S, as nccl-tests counts it) in every rank of `group` (None: the default one).

    The first call is checked and also warms up; `warmup` more calls follow, then `iterations` timed ones.
    """
    run, check = _prepare(op, total_bytes, device, group)
    run()
    wrong = not check()
    for _ in range(warmup):
        run()
    _sync(device)
    dist.barrier(group)  # all ranks start the clock together
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    _sync(device)
    seconds = (time.perf_counter() - start) / iterations
    # The collective took as long as its slowest rank; one wrong rank makes the result wrong.
    stats = torch.tensor([seconds, float(wrong)], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    seconds, wrong = stats.tolist()
    algbw = total_bytes / seconds / 1e9
    busbw = algbw * bus_factor(op, dist.get_world_size(group))
    return dict(op=op, bytes=total_bytes, time_s=seconds, algbw_GBps=algbw, busbw_GBps=busbw, correct=not wrong)


def run_worker(out: str, config: CollectivesConfig) -> None:
    """In each launched process: every op at every size; each node's first process writes the results to `out`
    (its own launcher's file: on one node, rank 0's)."""
    env = DistEnv.from_environ()
    init_process_group(env, env.default_backend(), timedelta(minutes=5))
    # GPU tensors go through NCCL; the gloo beside it (see multigpu.core.env.group_backend) only serves CPU tensors.
    world, backend = dist.get_world_size(), "nccl" if "nccl" in dist.get_backend() else dist.get_backend()
    results = [
        measure(op, size, config.iterations, config.warmup, env.device)
        for op in config.op_list
        for size in sizes(config, world)
    ]
    nodes = each_node(config, env) if config.per_node else None
    if env.local_rank == 0:
        notes = [GLOO_REDUCE_SCATTER] if backend == "gloo" and "reduce_scatter" in config.op_list else []
        device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
        result = {"backend": backend, "world_size": world, "device": device, "results": results, "notes": notes}
        Path(out).write_text(json.dumps(result if nodes is None else {**result, "nodes": nodes}, indent=2))
    dist.destroy_process_group()


def each_node(config: CollectivesConfig, env: DistEnv) -> list[dict]:
    """Every node, in node order, as every rank sees it: its processes, its interface and address toward node 0,
    and each op timed within its processes (none for a node of one process). The nodes time theirs at once, as a
    hierarchical collective runs them."""
    members, group = node_groups(env)
    size = dist.get_world_size(group)
    route = route_to(env.master_addr, "MASTER_ADDR")
    rows = [
        measure(op, total, config.iterations, config.warmup, env.device, group)
        for op in config.op_list
        for total in (sizes(config, size) if size > 1 else [])
    ]
    mine = {"processes": size, "interface": route.interface, "address": route.address, "results": rows}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [{"node": node, **everyone[ranks[0]]} for node, ranks in enumerate(members)]


def node_groups(env: DistEnv) -> tuple[list[list[int]], Any]:
    """Each node's ranks, in node order, and the process group of this rank's node (new_group is called by every
    rank for every group, as it requires). A rank's node is torchrun's GROUP_RANK, the node rank its launcher
    was given."""
    mine = int(os.environ.get("GROUP_RANK", env.rank // env.local_world_size))
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, mine)
    members = [[rank for rank, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
    groups = [dist.new_group(ranks) for ranks in members]
    return members, next(g for ranks, g in zip(members, groups, strict=True) if env.rank in ranks)


def run_collectives(config: CollectivesConfig, launch_config: LaunchConfig | None = None) -> dict:
    """Runs the benchmark in `config.nproc` processes (on each node of `launch_config`, if given); returns the
    results that this node's first process wrote (and writes them to json_out)."""
    from multigpu.launch.launcher import LaunchConfig, launch

    launch_config = launch_config or LaunchConfig(nproc=config.nproc)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        # Workers read their number from the launcher; and torchrun's own parser takes --nproc for its --nproc-per-node.
        flags = config_to_argv(config, skip=("nproc", "json_out"))
        argv = ["multigpu.tools.collectives", "--worker", str(out), *flags]
        code = launch(replace(launch_config, nproc=config.nproc), argv, module=True)
        if code != 0 or not out.is_file():
            raise BenchmarkFailed(
                f"The {config.nproc}-process collectives benchmark failed (exit code {code}; the workers' errors are "
                "printed above): check MASTER_ADDR/ports, firewalls, and NCCL_DEBUG=INFO output.",
                code or 1,
            )
        result = json.loads(out.read_text())
    if config.json_out:
        Path(config.json_out).write_text(json.dumps(result, indent=2))
    return result


def calibrate(config: CollectivesConfig, out: Path) -> int:
    """`multigpu bench --collectives`: the tables, and OUT/collectives.json for `multigpu simulate --calibration`;
    returns the exit code (a failed worker's, if one failed)."""
    out.mkdir(parents=True, exist_ok=True)
    config = replace(config, json_out=str(out / "collectives.json"))
    try:
        print_collectives(run_collectives(config))
    except BenchmarkFailed as failure:
        print(f"multigpu bench: {failure}", file=sys.stderr)
        return failure.code
    print(f"wrote {config.json_out} (calibrates multigpu simulate --calibration)")
    return 0


def human(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def print_collectives(result: dict) -> None:
    """One table per collective, with nccl-tests' columns."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)  # a log or a pipe gets the whole table
    n = result["world_size"]
    for op in dict.fromkeys(row["op"] for row in result["results"]):
        table = Table(
            title=f"{op}: {n} processes, {result['backend']} on {result['device']}",
            caption=f"GB = 1e9 bytes; busbw = algbw x {bus_factor(op, n):.3g} (nccl-tests' factor for {n} ranks)",
        )
        for column in ("size", "elements", "time (µs)", "algbw (GB/s)", "busbw (GB/s)", "correct"):
            table.add_column(column, justify="right")
        for row in (row for row in result["results"] if row["op"] == op):
            speeds = [f"{row['time_s'] * 1e6:.1f}", f"{row['algbw_GBps']:.3f}", f"{row['busbw_GBps']:.3f}"]
            table.add_row(human(row["bytes"]), str(row["bytes"] // 4), *speeds, "yes" if row["correct"] else "WRONG")
        console.print(table)
    for note in result.get("notes", []):
        console.print(f"note: {note}")


def main(argv: list[str]) -> int:
    worker_out, argv = (argv[1], argv[2:]) if argv[:1] == ["--worker"] else (None, argv)
    parser = Parser(
        prog="python -m multigpu.tools.collectives", description="Collective bandwidth as nccl-tests reports it."
    )
    add_config_arguments(parser, CollectivesConfig)
    args = parser.parse_args(argv)
    if worker_out is not None:
        run_worker(worker_out, config_from_args(CollectivesConfig, args))
        return 0

    def bench() -> int:
        try:
            result = run_collectives(config_from_args(CollectivesConfig, args))
        except BenchmarkFailed as error:
            print(error, file=sys.stderr)
            return error.code
        print_collectives(result)
        return 0 if all(row["correct"] for row in result["results"]) else 1

    return exit_on_usage_error(bench)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
