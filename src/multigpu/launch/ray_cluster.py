"""`multigpu run --ray ADDRESS -n N`: the same script, unchanged, in N workers on a Ray cluster (KubeRay included).

Plain Ray actors, not Ray Train's TorchTrainer: TorchTrainer runs a Python function inside its actor and creates the
process group itself, so a script that calls `dist.init_process_group` (every torchrun script does) would fail as
initialised twice; the script must run as a file or module with torchrun's variables, unchanged; and multigpu's
worker bootstrap (multigpu.launch.worker) ends its process with os._exit, which would end Ray's actor with it. So
each worker is a subprocess of a small actor, exactly what `multigpu run` starts: `python -m multigpu.launch.worker
SCRIPT ARGS`.

What Ray does: it places the N workers (a placement group of N bundles {CPU: c, GPU: g}, packed onto as few nodes
as it can), gives each actor its GPU (ray.get_gpu_ids), and notices an actor or node that dies (RayActorError).
What the driver (this process) does: ranks grouped by node (NODE_RANK in node order, LOCAL_RANK within a node, rank
0's node the MASTER_ADDR, a port rank 0's actor found free the MASTER_PORT), each node's workers seeing all of the
node's GPUs the run holds in local-rank order (CUDA_VISIBLE_DEVICES) so that cuda:LOCAL_RANK is a worker's own, as
Ray Train arranges; each worker's lines printed as they come, as torchrun prints them; the first failure said once
(multigpu.launch.failures, from the notes each worker leaves on its node); and --max-restarts: every worker ended
and started again, TORCHELASTIC_RESTART_COUNT one more, so the recipes resume from their newest checkpoint.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from multigpu.core.errors import UsageError
from multigpu.core.launcher_notes import LAUNCHER_DIR, LAUNCHER_STORE, usage_error_noted
from multigpu.launch.failures import first_failure, report_failure
from multigpu.launch.ray_host import WorkerHost
from multigpu.launch.stop import LAUNCHER_PID, checkpoint_note, raising_on_stop, report_stop
from multigpu.launch.worker_env import lightning_environment, use_cpu_for_accelerate

INSTALL = "pip install 'multigpu[ray]'"
#: The driver's variables every worker gets too (the actors' own environment is the node's): multigpu's, torch's,
#: the collectives', OpenMP's, Hugging Face's, the trackers' and Python's path and buffering.
FORWARDED = ("MULTIGPU_", "TORCH", "NCCL_", "GLOO_", "OMP_", "HF_", "TRANSFORMERS_", "WANDB_", "MLFLOW_", "ACCELERATE_")
FORWARDED_NAMES = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PL_TRAINER_DEVICES", "PL_TRAINER_NUM_NODES")
#: What this launcher sets for each worker itself: never forwarded from the driver.
OWN = (LAUNCHER_DIR, LAUNCHER_PID, LAUNCHER_STORE, "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
PLACEMENT_TIMEOUT_S = 60.0  # how long the workers may wait for the cluster to free (or add) their resources
PROBE_TIMEOUT_S = 5.0
POLL_S = 0.1


class RaySettings(Protocol):
    """The launch settings a run on Ray reads: multigpu.launch.launcher's LaunchConfig, which calls this module."""

    ray: str | None
    ray_gpus_per_worker: int | None
    ray_cpus_per_worker: int
    nproc: int | None
    max_restarts: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    gpu_ids: str | None
    share_gpus: bool
    replica_groups: int
    replica_id: int | None
    lighthouse: str | None


def check_settings(config: RaySettings) -> None:
    """Refuses, in one sentence, what does not go with --ray: Ray places the workers and names node 0 itself."""
    if config.ray is None:
        if config.ray_gpus_per_worker is not None or config.ray_cpus_per_worker != 1:
            raise UsageError("--ray-gpus-per-worker and --ray-cpus-per-worker size the workers of --ray; add --ray.")
        return
    placed_by_ray = {
        "--nnodes": config.nnodes != 1,
        "--node-rank": config.node_rank != 0,
        "--master-addr": config.master_addr != "127.0.0.1",
        "--master-port": config.master_port is not None,
        "--gpu-ids": config.gpu_ids is not None,
        "--share-gpus": config.share_gpus,
        "--replica-groups": config.replica_groups != 1,
        "--replica-id": config.replica_id is not None,
        "--lighthouse": config.lighthouse is not None,
    }
    given = [flag for flag, set_ in placed_by_ray.items() if set_]
    if given:
        raise UsageError(
            f"--ray places the workers on the cluster's nodes and GPUs itself, so {given[0]} has no say; drop it."
        )
    if config.ray_gpus_per_worker not in (None, 0, 1):
        raise UsageError(
            f"--ray-gpus-per-worker must be 0 or 1 (got {config.ray_gpus_per_worker}): each worker drives one GPU, "
            "cuda:LOCAL_RANK, as under torchrun."
        )
    if config.ray_cpus_per_worker < 0:
        raise UsageError(f"--ray-cpus-per-worker must be 0 or more (got {config.ray_cpus_per_worker}).")


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError(f"--ray runs the workers on a Ray cluster, and Ray is not installed; {INSTALL}.") from None
    return ray


def connect(ray: Any, address: str) -> None:
    """Joins the cluster at `address` (`auto`, `local` or HOST:PORT), refusing in one sentence one that no Ray
    answers at, quickly (ray.init itself retries for a minute)."""
    # The workers' lines come through their actors (multigpu.launch.ray_host), not Ray's log forwarding.
    options = {"log_to_driver": False, "logging_level": "ERROR"}
    if address == "local":
        ray.init(address="local", include_dashboard=False, **options)  # a dashboard only for a cluster that stays
        return
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(
                f"--ray {address} is no address; pass HOST:PORT of the cluster's head (ray start --head prints it), "
                "auto on a node of the cluster, or local."
            )
        try:
            socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
        except OSError as error:
            raise UsageError(
                f"Nothing answers at --ray {address} ({error.strerror or error}); pass the address of a running "
                "Ray cluster's head (ray start --head prints it), auto on one of its nodes, or local."
            ) from None
    try:
        ray.init(address=address, **options)
    except ConnectionError as error:
        raise UsageError(
            f"Ray could not join --ray {address} ({error}); start a cluster (ray start --head) first."
        ) from None


def resources_per_worker(ray: Any, config: RaySettings) -> tuple[int, int, int]:
    """(workers, CPUs each, GPUs each): the GPUs default to 1 where the cluster has any, else 0; the workers to one
    per GPU, or 1. Refuses what the cluster does not have in all, in one sentence, before any worker."""
    total = ray.cluster_resources()
    cpus, gpus = int(total.get("CPU", 0)), int(total.get("GPU", 0))
    per_gpu = config.ray_gpus_per_worker if config.ray_gpus_per_worker is not None else int(gpus > 0)
    per_cpu = config.ray_cpus_per_worker
    if not per_cpu and not per_gpu:
        raise UsageError("--ray-cpus-per-worker 0 without a GPU leaves each worker nothing to hold; pass 1 or more.")
    workers = config.nproc or (gpus if per_gpu else 1)
    if workers * per_cpu > cpus or workers * per_gpu > gpus:
        raise UsageError(
            f"--nproc {workers} Ray workers of {per_cpu} CPU and {per_gpu} GPU each need {workers * per_cpu} CPUs and "
            f"{workers * per_gpu} GPUs, and the cluster at --ray {config.ray} has {cpus} CPUs and {gpus} GPUs; "
            "pass fewer workers or fewer resources each (--ray-cpus-per-worker, --ray-gpus-per-worker)."
        )
    return workers, per_cpu, per_gpu


@dataclass
class Placed:
    """A worker's actor and its rank's place in the run."""

    actor: Any
    ip: str
    node: str
    gpus: list[str]
    port: int
    pid: int  # the actor's process
    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0


def ranked(actors: list[Any], places: list[dict[str, Any]]) -> list[Placed]:
    """The workers in rank order: grouped by node, the nodes in the order their first worker was placed."""
    placed = [
        Placed(actor, place["ip"], place["node"], place["gpus"], place["port"], place["pid"])
        for actor, place in zip(actors, places, strict=True)
    ]
    nodes = list(dict.fromkeys(worker.node for worker in placed))
    placed.sort(key=lambda worker: nodes.index(worker.node))
    for rank, worker in enumerate(placed):
        worker.rank, worker.node_rank = rank, nodes.index(worker.node)
        worker.local_rank = sum(other.node == worker.node for other in placed[:rank])
    return placed


def forwarded_environment() -> dict[str, str]:
    """The driver's variables each worker gets (FORWARDED), OMP_NUM_THREADS 1 unless set, as `multigpu run`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if (name.startswith(FORWARDED) or name in FORWARDED_NAMES) and name not in OWN
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def worker_environment(worker: Placed, workers: list[Placed], restart: int, config: RaySettings) -> dict[str, str]:
    """torchrun's variables for `worker`, and what `multigpu run` adds (multigpu.launch.worker_env)."""
    node = [other for other in workers if other.node == worker.node]
    nodes = workers[-1].node_rank + 1
    env = {
        "RANK": str(worker.rank),
        "LOCAL_RANK": str(worker.local_rank),
        "WORLD_SIZE": str(len(workers)),
        "LOCAL_WORLD_SIZE": str(len(node)),
        "GROUP_RANK": str(worker.node_rank),
        "NODE_RANK": str(worker.node_rank),
        "ROLE_RANK": str(worker.rank),
        "ROLE_WORLD_SIZE": str(len(workers)),
        "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": workers[0].ip,
        "MASTER_PORT": str(workers[0].port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        LAUNCHER_PID: str(worker.pid),  # the worker dies with its actor
        # Each node's workers see the node's GPUs of this run in local-rank order: cuda:LOCAL_RANK is a worker's own,
        # and peers on the node can reach each other's GPU (NCCL's P2P and NVLink need both visible).
        "CUDA_VISIBLE_DEVICES": ",".join(gpu for other in node for gpu in other.gpus),
    }
    return env | {name: value for name, value in lightning_environment(len(node), nodes).items() if name not in env}


@dataclass
class Outcome:
    """How one start of the workers ended: their exit codes by rank, a rank whose actor was lost, the notes."""

    codes: dict[int, int]
    pids: dict[int, int]
    lost: Placed | None
    notes: Path


def run_on_ray(config: RaySettings, target: list[str], module: bool, worker: Sequence[str]) -> int:
    """`launch` on the Ray cluster at config.ray: the exit code of the first worker that failed, 0 if none did."""
    ray = require_ray()
    connect(ray, config.ray)
    try:
        count, per_cpu, per_gpu = resources_per_worker(ray, config)
        if not per_gpu and count > 1:
            use_cpu_for_accelerate(count)
        bundle = {"CPU": per_cpu} | ({"GPU": per_gpu} if per_gpu else {})
        group = ray.util.placement_group([bundle] * count, strategy="PACK")
        argv = ["-m", *worker, *(["-m"] if module else []), *target]
        try:
            with tempfile.TemporaryDirectory(prefix="multigpu-ray-") as notes:
                return restarting(ray, config, group, bundle, argv, Path(notes))
        finally:
            ray.util.remove_placement_group(group)  # at once: the cluster's next job may need its resources
    finally:
        ray.shutdown()


def restarting(ray: Any, config: RaySettings, group: Any, bundle: dict, argv: list[str], notes: Path) -> int:
    """Starts the workers, and again after a failure, up to --max-restarts times; says how the run ended."""
    for restart in range(config.max_restarts + 1):
        outcome = start_workers(ray, config, group, bundle, argv, restart, notes / str(restart))
        failed = {rank: code for rank, code in outcome.codes.items() if code != 0}
        if not failed and outcome.lost is None:
            return 0
        final = restart == config.max_restarts or usage_error_noted(outcome.notes)
        if outcome.lost is not None:
            where = (
                f"worker rank {outcome.lost.rank}'s Ray actor on {outcome.lost.ip} was lost (its node or process died)"
            )
            if final:
                saved = checkpoint_note(outcome.notes)
                print(
                    f"multigpu run: {where}, so every worker was stopped{f'; {saved}' if saved else ''}.",
                    file=sys.stderr,
                )
                return 1
        else:
            failures = {
                rank: ProcessFailure(rank, outcome.pids[rank], code, error_file="") for rank, code in failed.items()
            }
            error = ChildFailedError("multigpu run --ray", failures)
            if final:
                return report_failure(error, outcome.notes)
            rank, _, how = first_failure(error, outcome.notes)  # the cause, not the survivors stopped after it
            where = f"worker rank {rank} {how}"
        print(
            f"multigpu run: {where}; restarting every worker ({restart + 1} of {config.max_restarts}).", file=sys.stderr
        )
    raise AssertionError("unreachable: the last start returns")


def start_workers(
    ray: Any, config: RaySettings, group: Any, bundle: dict, argv: list[str], restart: int, notes: Path
) -> Outcome:
    """One start of every worker: placed, ranked, run to the end or the first failure, their notes gathered."""
    placed = place_workers(ray, config, group, bundle)
    folder = os.path.join(tempfile.gettempdir(), f"multigpu-ray-{uuid.uuid4().hex}")  # on each worker's node
    env = forwarded_environment() | {LAUNCHER_DIR: folder}
    cwd = os.getcwd()
    pids = ray.get(
        [w.actor.start.remote(argv, env | worker_environment(w, placed, restart, config), cwd) for w in placed]
    )
    outcome = Outcome({}, {w.rank: pid for w, pid in zip(placed, pids, strict=True)}, None, notes)
    try:
        with raising_on_stop():
            watch(ray, placed, outcome)
    except SignalException as stopped:
        end_workers(ray, placed, folder, outcome)
        raise SystemExit(report_stop(stopped.sigval, notes)) from None
    end_workers(ray, placed, folder, outcome)
    return outcome


def place_workers(ray: Any, config: RaySettings, group: Any, bundle: dict) -> list[Placed]:
    """An actor in each bundle of the placement group, once Ray has placed them all; in rank order."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise UsageError(
            f"The Ray cluster at --ray {config.ray} could not place {len(group.bundle_specs)} workers of {bundle} "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s (it has {ray.available_resources()} free, and each worker must fit "
            "on one node); pass fewer workers or fewer resources each, or free the cluster."
        ) from None
    host = ray.remote(WorkerHost)
    actors = [
        host.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()
        for index in range(len(group.bundle_specs))
    ]
    places = ray.get([actor.place.remote(os.getcwd()) for actor in actors])
    lacking = [place["ip"] for place in places if not place["cwd"]]
    if lacking:
        raise UsageError(
            f"This directory, {os.getcwd()}, does not exist on the Ray node {lacking[0]}; run from a path every node "
            "sees (a shared volume), where the script, its data and its checkpoints live."
        )
    return ranked(actors, places)


def watch(ray: Any, placed: list[Placed], outcome: Outcome) -> None:
    """Prints every worker's lines as they come, until all have ended or one has failed or been lost."""
    running = {worker.rank: worker for worker in placed}
    while running:
        polls = [(worker, worker.actor.poll.remote()) for worker in running.values()]
        for worker, poll in polls:
            try:
                lines, code = ray.get(poll)
            except ray.exceptions.RayActorError:
                outcome.lost = worker
                return
            for stream, line in lines:
                (sys.stdout if stream == 1 else sys.stderr).write(line)
            if code is not None:
                outcome.codes[worker.rank] = code
                running.pop(worker.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        if any(code != 0 for code in outcome.codes.values()):
            return
        time.sleep(POLL_S)


def end_workers(ray: Any, placed: list[Placed], folder: str, outcome: Outcome) -> None:
    """Stops the workers still running, prints their last lines, gathers every node's notes, ends the actors."""
    alive = [worker for worker in placed if worker is not outcome.lost]
    outcome.notes.mkdir(parents=True, exist_ok=True)
    for worker, result in zip(alive, gathered(ray, [w.actor.stop.remote() for w in alive]), strict=True):
        if result is None:
            continue
        lines, code = gathered(ray, [worker.actor.poll.remote()])[0] or ([], None)
        for stream, line in lines:
            (sys.stdout if stream == 1 else sys.stderr).write(line)
        if code is not None and worker.rank not in outcome.codes:
            outcome.codes[worker.rank] = code
    for found in gathered(ray, [worker.actor.notes.remote(folder) for worker in alive]):
        for name, text in (found or {}).items():
            (outcome.notes / name).write_text(text)
    for worker in placed:
        ray.kill(worker.actor)


def gathered(ray: Any, refs: list[Any]) -> list[Any]:
    """Each call's result, None for one whose actor is gone."""
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref) if ref is not None else None)
        except ray.exceptions.RayActorError:
            results.append(None)
    return results
