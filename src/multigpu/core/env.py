"""Who am I in the job? Rank, world size and rendezvous read from whichever launcher started us."""

from __future__ import annotations

import atexit
import gc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from multigpu.core.errors import UsageError
from multigpu.core.network import interface_environment, route_to
from multigpu.core.ports import free_port

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # torchrun | mpi | slurm | none

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Reads torchrun / `accelerate launch` variables first, then Open MPI, then SLURM.

        torchrun's variables win because torchrun is often started *inside* a SLURM or MPI allocation,
        where the outer variables describe the allocation rather than our processes.
        """
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            world = _int(env, "WORLD_SIZE")
            return cls(
                rank=_int(env, "RANK"),
                local_rank=_int(env, "LOCAL_RANK", 0),
                world_size=world,
                local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(env, "MASTER_PORT", 29500),
                launcher="torchrun",
            )
        if "OMPI_COMM_WORLD_RANK" in env:
            world = _int(env, "OMPI_COMM_WORLD_SIZE")
            local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
            if "MASTER_ADDR" not in env and local_world != world:
                raise UsageError(
                    "Open MPI spans several nodes but MASTER_ADDR is not set; export MASTER_ADDR=<first node's "
                    "address> (and MASTER_PORT) to every rank, e.g. with mpirun -x MASTER_ADDR."
                )
            return cls(
                rank=_int(env, "OMPI_COMM_WORLD_RANK"),
                local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                world_size=world,
                local_world_size=local_world,
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(env, "MASTER_PORT", 29500),
                launcher="mpi",
            )
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            world = _int(env, "SLURM_NTASKS")
            per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
            job_id = _int(env, "SLURM_JOB_ID", 0)
            return cls(
                rank=_int(env, "SLURM_PROCID"),
                local_rank=_int(env, "SLURM_LOCALID", 0),
                world_size=world,
                # SLURM writes '4(x2)' for four tasks on each of two nodes.
                local_world_size=int(re.match(r"\d*", per_node).group() or world),
                master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
                # Every task of a job derives the same port without talking to the others.
                master_port=_int(env, "MASTER_PORT", 15000 + job_id % 20000),
                launcher="slurm",
            )
        return cls()

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def shares_gpus(self) -> bool:
        """More processes on this node than GPUs (`--share-gpus`): they take the GPUs in turn."""
        return torch.cuda.is_available() and self.local_world_size > torch.cuda.device_count()

    def default_backend(self) -> str:
        return "nccl" if self.device.type == "cuda" and not self.shares_gpus else "gloo"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise UsageError(
                f"The launcher set no {name}; start the job with `multigpu run`, torchrun, srun or mpirun."
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer; fix the launcher's environment.") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        raise UsageError(f"Cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR to the first node's address.")
    prefix, ranges = first.group(1), first.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def check_backend(backend: str, env: DistEnv) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"Unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if backend == "nccl" and (env.device.type != "cuda" or not dist.is_nccl_available()):
        raise UsageError(
            "The nccl backend needs CUDA GPUs and a CUDA build of torch, and this machine has neither; "
            "use backend 'gloo' (the default on CPU) or run on a GPU machine."
        )
    if backend == "nccl" and env.shares_gpus:
        raise UsageError(
            f"{env.local_world_size} processes share this node's {torch.cuda.device_count()} GPU(s), and NCCL "
            "refuses two ranks on one GPU; leave the backend unset (gloo is then the default) or start one process "
            "per GPU."
        )


def init_process_group(env: DistEnv, backend: str, timeout: timedelta) -> None:
    """Joins (or, for a lone process, creates) the default process group; a no-op if one exists."""
    if dist.is_initialized():
        return
    device = env.device
    check_backend(backend, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size > env.local_world_size:
        # Several nodes: talk on the interface that reaches node 0 (`multigpu run` has set it already; srun,
        # mpirun and a plain torchrun have not), not on the one the hostname names, often loopback.
        os.environ.update(interface_environment(route_to(env.master_addr, "MASTER_ADDR")))
    if env.launcher == "torchrun":
        # torchrun's agent already serves a store at MASTER_PORT; env:// joins it instead of binding again.
        init_method = "env://"
    elif env.world_size == 1:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        init_method = f"tcp://{env.master_addr}:{env.master_port}"
    dist.init_process_group(
        group_backend(backend), init_method=init_method, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    atexit.register(destroy_process_groups)


def group_backend(backend: str) -> str:
    """The backend string for init_process_group: NCCL serves GPU tensors only, so gloo serves the CPU ones beside it
    (zero3's offloaded shards and their gradient norm, checkpoints' background writes, one-process groups)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def collective_device(device: torch.device) -> torch.device:
    """Where a tensor for a collective of the default group must be: this GPU under NCCL, else the CPU."""
    return device if device.type == "cuda" and "nccl" in dist.get_backend() else torch.device("cpu")


REDUCE_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def grouped() -> bool:
    """Whether this process is one of several in a process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_value(value: float | torch.Tensor, op: str, device: torch.device) -> float | torch.Tensor:
    """`value` combined over all ranks ("mean", "sum" or "max"), returned on every rank as the same type."""
    if op not in REDUCE_OPS:
        raise UsageError(f"Unknown reduce op {op!r}; choose one of {', '.join(REDUCE_OPS)}.")
    if not grouped():  # a copy, as with several processes: the caller may change its own in place
        return value.detach().clone() if isinstance(value, torch.Tensor) else value
    is_tensor = isinstance(value, torch.Tensor)
    tensor = value.detach() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
    work = tensor.to(collective_device(device), copy=True)
    dist.all_reduce(work, op=REDUCE_OPS[op])
    if op == "mean":
        work = work / dist.get_world_size()
    return work.to(tensor.device) if is_tensor else float(work)


def all_gather_rows(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's rows of `tensor`, concatenated in rank order; the ranks may hold different numbers of rows."""
    world, on = dist.get_world_size(), collective_device(device)
    local = tensor.detach().to(on)
    sizes = [torch.zeros((), dtype=torch.long, device=on) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(len(local), device=on))
    padded = torch.zeros((int(max(sizes)), *local.shape[1:]), dtype=local.dtype, device=on)
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    rows = torch.cat([part[: int(size)] for part, size in zip(parts, sizes, strict=True)])
    return rows.to(tensor.device)


def destroy_process_groups() -> None:
    """Tears down every process group while the interpreter is still whole (see multigpu/worker.py for why)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # drop cycles that still hold a group, so its threads are joined now and not at finalisation
