"""`multigpu run`: torch.distributed.run with free ports, GPU selection and one clear failure report."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.machinery
import importlib.util
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import api as rendezvous_api
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as torch_run

from multigpu.config.settings import Settings, setting
from multigpu.core.errors import UsageError
from multigpu.core.launcher_notes import LAST_CHECKPOINT, LAUNCHER_DIR, LAUNCHER_STORE, launcher_note
from multigpu.core.ports import free_port
from multigpu.core.replica_env import GROUPS, MIN_REPLICAS, ReplicaGroup
from multigpu.launch import lighthouse, ray_cluster, replica_groups
from multigpu.launch.exit_watch import ending_stuck_workers, stuck_lines
from multigpu.launch.failures import (
    holding_failure_lines,
    quiet_after_usage_error,
    quiet_when_stopped,
    release,
    report_failure,
)
from multigpu.launch.heartbeat import NodeInfo, NodeWatch, check_node_timeouts, heartbeat_port
from multigpu.launch.nodes import prepare_node
from multigpu.launch.several_nodes import a_lost_node_explains, report_lost, run_nodes
from multigpu.launch.stop import LAUNCHER_PID, raising_on_stop, report_stop
from multigpu.launch.worker_env import lightning_defaults, use_cpu_for_accelerate
from multigpu.observers.flight_recorder import nccl_watchdog_environment

WORKER = ("multigpu.launch.worker",)  # what each process runs: see its module doc


#: How a run recovers from a failure: the LaunchConfig settings each training verb shows as they are.
RECOVERY = ("max_restarts", "replica_groups", "replica_id", "lighthouse", "min_replicas")
#: Where the workers run when not here: the LaunchConfig settings each launching verb shows as they are.
RAY = ("ray", "ray_gpus_per_worker", "ray_cpus_per_worker")


@dataclass
class LaunchConfig(Settings):
    nproc: int | None = setting(None, "processes per node (default: the visible GPUs, or 1 without GPUs)")
    gpu_ids: str | None = setting(
        None,
        "comma-separated GPU indices to use, e.g. 0,1,3, counted among the GPUs CUDA_VISIBLE_DEVICES already exposes "
        "if it is set (sets CUDA_VISIBLE_DEVICES)",
    )
    nnodes: int = setting(1, "number of machines")
    node_rank: int = setting(0, "this machine's index, 0..nnodes-1")
    master_addr: str = setting("127.0.0.1", "address of node 0 (several nodes)")
    master_port: int | None = setting(None, "port on node 0; a free one is picked on a single node")
    max_restarts: int = setting(0, "restart all workers up to K times after a failure")
    join_timeout: float = setting(
        600.0,
        "several nodes: seconds each node waits for all of them to start (each start of the workers); then one "
        "sentence says which did not",
    )
    node_timeout: float = setting(
        15.0,
        "several nodes: seconds without a node's heartbeat after which it counts as lost and every node stops its "
        "workers (the collective timeout stays as set)",
    )
    share_gpus: bool = setting(
        False,
        "let --nproc exceed the GPUs, processes taking the GPUs in turn and talking over gloo (NCCL refuses two "
        "ranks on one GPU): to try a multi-process run on one GPU",
    )
    replica_groups: int = setting(
        1,
        "data-parallel replica groups that train under torchft fault tolerance: a group that dies is restarted "
        "(--max-restarts) and heals from a live one while the others train on",
    )
    replica_id: int | None = setting(
        None,
        "this launch's replica group on a cluster, 0..N-1 for --replica-groups N (default: on one machine, start all "
        "N groups here)",
    )
    lighthouse: str | None = setting(
        None,
        "HOST:PORT of the lighthouse `multigpu lighthouse` started, for --replica-id (default: on one machine, one "
        "started here)",
    )
    min_replicas: int = setting(
        1, "the fewest replica groups that may commit a step; with fewer the run ends, saying so in one sentence"
    )
    ray: str | None = setting(
        None,
        "run the workers on the Ray cluster at this address instead: HOST:PORT of its head, auto (the cluster this "
        "machine belongs to) or local (a Ray instance started here for the run); --nproc counts every worker",
        metavar="ADDRESS",
    )
    ray_gpus_per_worker: int | None = setting(
        None, "GPUs each Ray worker holds, 0 or 1 (default: 1 where the cluster has GPUs, else 0)"
    )
    ray_cpus_per_worker: int = setting(1, "CPUs each Ray worker holds")

    def check(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise UsageError(f"--nproc must be 1 or more (got {self.nproc}).")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}.")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more (got {self.max_restarts}).")
        if self.nnodes > 1 and self.master_port is None:
            raise UsageError("Several nodes need the same --master-port on every node; pass e.g. --master-port 29500.")
        if self.master_port is not None and not 0 < self.master_port < 65535:
            raise UsageError(
                f"--master-port must be in 1..65534 (got {self.master_port}): node 0 also listens on the next one."
            )
        check_node_timeouts(self.join_timeout, self.node_timeout)
        lighthouse.check_replica_settings(self)
        ray_cluster.check_settings(self)


def parse_gpu_ids(gpu_ids: str, present: int, where: str = "this machine has") -> list[int]:
    """The indices in --gpu-ids, each checked against the `present` GPUs torch sees (`where` says whose count)."""
    try:
        ids = [int(part) for part in gpu_ids.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--gpu-ids {gpu_ids!r} must be comma-separated integers such as 0,1,3.") from None
    absent = [i for i in ids if not 0 <= i < present]
    if not ids or absent:
        raise UsageError(
            f"--gpu-ids {gpu_ids} names GPUs that are not present ({where} {present}: "
            f"{', '.join(map(str, range(present))) or 'none'}); choose among those."
        )
    if len(set(ids)) != len(ids):
        raise UsageError(f"--gpu-ids {gpu_ids} names a GPU twice; list each GPU once.")
    return ids


def select_gpus(config: LaunchConfig, present: int, cuda_visible_devices: str | None) -> tuple[int, str | None]:
    """The processes to start on this node, and the CUDA_VISIBLE_DEVICES to give them (None: leave it as it is).

    `present` is torch.cuda.device_count(), which counts only what `cuda_visible_devices` (the variable as the
    user left it) exposes; --gpu-ids index those GPUs, so with CUDA_VISIBLE_DEVICES=2,3, --gpu-ids 1 is GPU 3.
    """
    if config.share_gpus and not present:
        raise UsageError(
            "--share-gpus lets processes take this machine's GPUs in turn, and it has none; drop it (without GPUs "
            "every process runs on the CPU anyway)."
        )
    visible = visible_gpus(present, cuda_visible_devices)
    if cuda_visible_devices is None:
        where = "this machine has"
    else:
        where = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices} leaves"
    if config.gpu_ids is None:
        selected, usable = None, present
        gpus = f"the {present} GPU{'s' if present != 1 else ''} {where}"
    else:
        ids = parse_gpu_ids(config.gpu_ids, present, where)
        selected, usable = ",".join(visible[i] for i in ids), len(ids)
        gpus = f"the {usable} GPU{'s' if usable != 1 else ''} --gpu-ids {config.gpu_ids} names"
    nproc = config.nproc or max(usable, 1)
    # Without GPUs the workers run on CPU, as many as asked. With GPUs, two processes on one GPU make NCCL fail
    # on a duplicate device, so sharing is asked for by name (the Engine then defaults to gloo).
    if present and nproc > usable and not config.share_gpus:
        raise UsageError(
            f"--nproc {nproc} starts more processes than {gpus}, and each needs a GPU of its own; "
            f"pass --nproc {usable}{' or fewer' if usable > 1 else ''}, or --share-gpus to share them over gloo."
        )
    return nproc, selected


def visible_gpus(present: int, cuda_visible_devices: str | None) -> list[str]:
    """The `present` GPUs torch counts, as CUDA_VISIBLE_DEVICES names them (their indices where it is unset)."""
    if cuda_visible_devices is None:
        return [str(index) for index in range(present)]
    # CUDA stops at the first entry it cannot use, so the GPUs torch counts are the first `present` entries. They
    # are kept verbatim: an index, a GPU-<uuid> or a MIG-<uuid> each means something only to CUDA.
    return [entry.strip() for entry in cuda_visible_devices.split(",")][:present]


def usable_gpus(config: LaunchConfig, present: int, cuda_visible_devices: str | None) -> list[str]:
    """The GPUs a run may use, as CUDA_VISIBLE_DEVICES names them: those --gpu-ids names, else every visible one."""
    if not present:
        return []
    _, selected = select_gpus(replace(config, nproc=None), present, cuda_visible_devices)
    return visible_gpus(present, cuda_visible_devices) if selected is None else selected.split(",")


def check_target(target: list[str], module: bool) -> None:
    """Refuses, before any process starts, a script or module that no worker could run."""
    name = target[0]
    if module:
        if not module_found(name):
            raise UsageError(
                f"No module named {name} can be found from {os.getcwd()} or the Python path; check its name, "
                "or drop -m to run a script file."
            )
    elif os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "__main__.py")):  # `python DIR` runs DIR/__main__.py
            raise UsageError(f"{name} is a directory; pass the path of the Python script in it to run.")
    elif not os.path.isfile(name):
        how = "is not a file" if os.path.exists(name) else "does not exist"
        raise UsageError(f"{name} {how}; pass the path of a Python script, or -m MODULE.")


def module_found(name: str) -> bool:
    """Whether `python -m name` run here would find the module, without importing any package it lies in.

    The workers run from this directory, which a `multigpu` console script does not put on sys.path.
    """
    parts = name.split(".")
    try:
        spec = importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd()]) or importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return False
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), spec.submodule_search_locations)
    if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
        spec = importlib.machinery.PathFinder.find_spec(f"{name}.__main__", spec.submodule_search_locations)
    return spec is not None


def check_port_free(config: LaunchConfig) -> None:
    """Refuses a --master-port that another process holds on node 0.

    The rendezvous store would fail to bind it, join whatever listens there as a client instead, and wait for
    minutes without a word. The check binds as the store does (on every address, IPv6 and IPv4, with
    SO_REUSEADDR, so a port that only old connections in TIME_WAIT still name counts as free).
    """
    if config.master_port is None or config.node_rank != 0:
        return
    instead = ", or leave it out to get a free one" if config.nnodes == 1 else " (the same on every node)"
    ports = [config.master_port] + ([heartbeat_port(config.master_port)] if config.nnodes > 1 else [])
    for port in ports:
        name = (
            f"--master-port {port}"
            if port == config.master_port
            else f"Port {port} (the nodes' heartbeat, next to --master-port)"
        )
        for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue  # no IPv6 on this machine: the store listens on IPv4 alone
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((address, port))
                except OSError as error:
                    if error.errno == errno.EADDRINUSE:
                        raise UsageError(
                            f"{name} is already in use on this machine; pass another --master-port{instead}."
                        ) from None
                    if family == socket.AF_INET:  # IPv6 addresses may just be unavailable here
                        raise UsageError(
                            f"{name} cannot be opened on this machine ({error.strerror}); pass another "
                            f"--master-port{instead}."
                        ) from None


def torchrun_argv(
    config: LaunchConfig, nproc: int, target: list[str], module: bool, worker: Sequence[str] = WORKER
) -> list[str]:
    # Several nodes restart together (multigpu.launch.heartbeat), never one alone inside torch.distributed.run.
    restarts = config.max_restarts if config.nnodes == 1 else 0
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={config.nnodes}", f"--max-restarts={restarts}"]
    if config.nnodes == 1:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{config.master_port or free_port()}"]
    else:
        argv += [
            f"--node-rank={config.node_rank}",
            f"--master-addr={config.master_addr}",
            f"--master-port={config.master_port}",
        ]
    # Every worker runs the target through multigpu.launch.worker, which adds a clean process-group teardown at exit.
    return [*argv, "--module", *worker, *(["-m"] if module else []), *target]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, which a container or taskset narrows), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def crowding_warning(nproc: int, gpus: int, cores: int) -> str | None:
    """One line when this node's processes outnumber its CPU cores on a machine without GPUs (more processes than
    GPUs is refused in select_gpus): they take turns on the cores, and each reads its own batch, so the global batch
    grows with them while the run slows down. None where there are enough cores."""
    if gpus or nproc <= cores:
        return None
    return (
        f"multigpu: warning: --nproc {nproc} starts {nproc} processes on {cores} CPU core{'s' if cores != 1 else ''} "
        f"and no GPU: they share the cores, and the global batch is {nproc}x the per-process batch; pass --nproc "
        f"{cores} or fewer unless that is meant."
    )


def launch(config: LaunchConfig, target: list[str], module: bool = False, worker: Sequence[str] = WORKER) -> int:
    """Runs `target` (a script and its arguments, or a module with `module=True`) in N processes.

    `worker`: the module each process runs, with its own arguments, before the target's: multigpu.launch.worker,
    or a module that prepares the process and then hands over to it (bench and verify's multigpu.tools.harness).

    Returns the exit code of the first worker that failed, 0 if all succeeded. SIGINT or SIGTERM stops every
    worker and ends this process with the shell's code for the signal (SystemExit 130 or 143), so that bench and
    verify, which launch several runs, stop too.
    """
    check_target(target, module)
    if config.ray is not None:
        return ray_cluster.run_on_ray(config, target, module, worker)  # which alone imports Ray
    if config.replica_groups > 1 and config.replica_id is None:  # every group on this machine
        gpus = usable_gpus(config, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        return replica_groups.run_groups(config, target, module, gpus)
    check_port_free(config)
    replica_environment(config)
    present = torch.cuda.device_count()
    nproc, visible_devices = select_gpus(config, present, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    warning = crowding_warning(nproc, present, usable_cores())
    if warning:
        print(warning, file=sys.stderr)
    route = None
    if config.nnodes > 1:
        route = prepare_node(config.nnodes, config.node_rank, config.master_addr, config.master_port)
    if present == 0 and nproc * config.nnodes > 1:
        use_cpu_for_accelerate(nproc * config.nnodes)
    # The workers' rank 0 serves their store, not this process. Measured: with the rendezvous store shared,
    # restarted workers hang or fail in most runs; and a script's own processes (torch.multiprocessing.spawn)
    # inherit TORCHELASTIC_USE_AGENT_STORE=True, so none of them serves the store at the MASTER_PORT they set, and
    # they wait for it until the timeout. (Several nodes rendezvous statically, which always shares it.)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = get_args_parser().parse_args(torchrun_argv(config, nproc, target, module, worker))
    # Several nodes share the agent's store already (TORCHELASTIC_USE_AGENT_STORE); one node offers its own.
    os.environ.pop(LAUNCHER_STORE, None)
    if config.nnodes == 1:
        os.environ[LAUNCHER_STORE] = args.rdzv_endpoint
    ranks = range(config.node_rank * nproc, (config.node_rank + 1) * nproc)
    if route is None:
        return run_workers(args, present, ranks, lightning_defaults(nproc, config.nnodes))
    node = NodeInfo(config.node_rank, route.address, nproc)
    watch = NodeWatch(
        config.nnodes, node, config.master_addr, config.master_port, config.join_timeout, config.node_timeout
    )
    # a fresh context each start: a restart enters it again
    return run_nodes(
        lambda: run_workers(args, present, ranks, lightning_defaults(nproc, config.nnodes), watch), watch, config
    )


def replica_environment(config: LaunchConfig) -> None:
    """Gives this launch's workers their replica group (core/replica_env.py), where it is one of several; takes
    away a group that a launch above this one gave (a script's own `multigpu run` inside a worker is no group)."""
    if config.replica_id is None or config.lighthouse is None:
        for name in (GROUPS, MIN_REPLICAS):
            os.environ.pop(name, None)
        return
    lighthouse.require_torchft("--replica-id")
    group = ReplicaGroup(
        config.replica_id, config.replica_groups, lighthouse.url(config.lighthouse), config.min_replicas
    )
    os.environ.update(group.environment())


@contextlib.contextmanager
def store_port_outside_ephemeral_range() -> Iterator[None]:
    """The port torch's rendezvous gives the workers' store (their rank 0 binds it after its imports) chosen as
    core/ports.py's free_port chooses, not from the kernel's ephemeral range, where another process's connection
    can take it first."""
    torch_choice = rendezvous_api.get_free_port  # an AttributeError, not a silent no-op, if torch renames it
    rendezvous_api.get_free_port = free_port
    try:
        yield
    finally:
        rendezvous_api.get_free_port = torch_choice


def run_workers(
    args: argparse.Namespace,
    present: int,
    ranks: range,
    defaults: contextlib.AbstractContextManager[None],
    watch: NodeWatch | None = None,
) -> int:
    """One start of this node's workers under torch.distributed.run: their exit code, said in one place."""
    with tempfile.TemporaryDirectory(prefix="multigpu-exits-") as exits:
        os.environ[LAUNCHER_DIR] = exits
        os.environ[LAUNCHER_PID] = str(os.getpid())
        if present:
            for name, value in nccl_watchdog_environment(Path(exits)).items():
                os.environ.setdefault(name, value)
        held: list[logging.LogRecord] = []
        try:
            with (
                defaults,
                raising_on_stop(),
                quiet_after_usage_error(Path(exits)),
                quiet_when_stopped(),
                holding_failure_lines(held),  # the last filter: it holds only what the others let through
                ending_stuck_workers(Path(exits), ranks),
                store_port_outside_ephemeral_range(),
            ):
                torch_run(args)
        except ChildFailedError as error:
            if watch is not None and a_lost_node_explains(watch, Path(exits)):
                return report_lost(watch, Path(exits))
            return report_failure(error, Path(exits), held)
        except SignalException as stopped:
            release(held)
            if watch is not None and watch.lost is not None:
                return report_lost(watch, Path(exits))
            raise SystemExit(report_stop(stopped.sigval, Path(exits))) from None
        finally:
            if watch is not None:
                watch.workers_ended()
                watch.last_checkpoint = launcher_note(exits, LAST_CHECKPOINT) or watch.last_checkpoint
        release(held)  # a failure that a restart made good
        for line in stuck_lines(Path(exits)):
            print(line, file=sys.stderr)
    return 0
