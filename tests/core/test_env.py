from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from multigpu.core.env import DistEnv, check_backend, first_slurm_host
from multigpu.core.errors import UsageError


def test_nothing_set_is_one_process() -> None:
    assert DistEnv.from_environ({}) == DistEnv()


def test_torchrun_and_accelerate_variables() -> None:
    env = DistEnv.from_environ(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "1234",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("n0", 1234, "torchrun")


def test_slurm_variables() -> None:
    env = DistEnv.from_environ(
        {
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "4",
            "SLURM_NTASKS_PER_NODE": "2(x2)",
            "SLURM_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("gpu07", 15000 + 4242, "slurm")


def test_open_mpi_variables() -> None:
    env = DistEnv.from_environ(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.launcher) == (
        1,
        1,
        2,
        "127.0.0.1",
        "mpi",
    )


def test_open_mpi_across_nodes_needs_master_addr() -> None:
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        DistEnv.from_environ(
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
        )


def test_bad_integer_is_one_clear_sentence() -> None:
    with pytest.raises(UsageError, match="WORLD_SIZE='two' is not an integer"):
        DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("gpu[03-05,09],cpu1", "gpu03"),
        ("a-b[1,2]", "a-b1"),
        ("x1,x2", "x1"),
        ("n[0012-0020]", "n0012"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_device_and_backend_on_cpu() -> None:
    env = DistEnv()
    assert env.device.type == "cpu" and env.default_backend() == "gloo"


def test_processes_sharing_a_gpu_default_to_gloo_and_refuse_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--share-gpus` on a one-GPU machine (counts mocked: this runs without a GPU): rank 1 takes GPU 0 too, and
    NCCL, which refuses two ranks on one device at its first collective, is refused by name before it starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    shared = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)
    assert shared.device == torch.device("cuda", 0) and shared.shares_gpus and shared.default_backend() == "gloo"
    with pytest.raises(UsageError, match=r"^2 processes share this node's 1 GPU\(s\), and NCCL refuses two ranks"):
        check_backend("nccl", shared)
    check_backend("gloo", shared)
    alone = DistEnv()
    assert not alone.shares_gpus and alone.default_backend() == "nccl"
    check_backend("nccl", alone)
