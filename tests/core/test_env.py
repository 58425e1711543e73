from __future__ import annotations

import pytest

from multigpu.core.env import DistEnv, first_slurm_host
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
