"""`multigpu run --ray`: the same scripts, unchanged, on a Ray cluster, printing and failing as `multigpu run` does.

One local Ray instance (2 CPUs) serves the whole module: starting one takes ~20 s on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from safetensors.torch import load_file

from multigpu.core.ports import free_port
from tests.dist import descendants, multigpu, refusal, run_reference
from tests.launch.test_ecosystem_scripts import NANOGPT, val_losses
from tests.recipes.test_train import train_args, write_uci_har

pytest.importorskip("ray")

# A throwaway cluster on loopback: no usage report and no token (a local `ray.init` leaves one in ~/.ray, and a
# later `ray start` then requires it of every client).
QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
RAY = Path(sys.executable).with_name("ray")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """HOST:PORT of a Ray head started for this module (`ray start --block`), ended with everything it started."""
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    log = Path(temp, "start.log")
    argv = [str(RAY), "start", "--head", "--block", "--num-cpus", "2", "--include-dashboard=false"]
    argv += ["--object-store-memory", "100000000", "--port", str(port), "--temp-dir", temp, "--disable-usage-stats"]
    with log.open("w") as out:
        head = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ | QUIET
        )
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        with mock.patch.dict(os.environ, QUIET):  # for the refusals run in this process too
            yield f"127.0.0.1:{port}"
    finally:
        started = descendants(head.pid)
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=30)
        for pid in [head.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def on_ray(cluster: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180):
    """`multigpu run --ray CLUSTER ARGS` as a user types it."""
    return multigpu("run", "--ray", cluster, *args, env=QUIET | (env or {}), timeout=timeout)


def epochs(output: str) -> list[str]:
    """The demo's epoch lines without their times."""
    return [re.sub(r"\s+[\d.]+s$", "", line) for line in output.splitlines() if line.startswith("epoch ")]


def test_the_demo_prints_what_multigpu_run_prints(cluster: str) -> None:
    reference = run_reference("multigpu.recipes.demo", ["--epochs", "2"])
    result = on_ray(cluster, "-n", "2", "-m", "multigpu.recipes.demo", "--epochs", "2")
    assert result.returncode == 0, result.stdout
    assert epochs(result.stdout) == epochs(reference) and len(epochs(reference)) == 2, result.stdout
    assert "strategy ddp, precision 32, 2 process(es)" in result.stdout


SCRIPT = """
import os, sys
import torch.distributed as dist
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "ACCELERATE_USE_CPU", "PL_TRAINER_DEVICES",
         "PL_TRAINER_NUM_NODES", "TORCH_X")
print(" ".join(f"{name}={os.environ.get(name)}" for name in names), flush=True)
dist.init_process_group("gloo")  # as under torchrun: the script makes its own group
dist.barrier()
if sys.argv[1] == "crash" and dist.get_rank() == 1:
    raise RuntimeError("rank one broke on purpose")
if sys.argv[1] == "usage" and dist.get_rank() == 1:
    from multigpu.core.errors import UsageError
    raise UsageError("Rank one refuses this setting; pass another.")
dist.barrier()
"""


def test_each_worker_gets_torchruns_variables_and_a_crash_is_said_once(cluster: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = on_ray(cluster, "-n", "2", str(script), "crash", env={"TORCH_X": "1"})
    assert result.returncode == 1, result.stdout
    for rank in (0, 1):
        assert (
            f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 MASTER_ADDR=" in result.stdout
        )
    assert result.stdout.count("TORCHELASTIC_RESTART_COUNT=0 OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=true") == 2
    assert result.stdout.count("PL_TRAINER_DEVICES=2 PL_TRAINER_NUM_NODES=1 TORCH_X=1") == 2  # TORCH*: forwarded
    assert result.stdout.count("RuntimeError: rank one broke on purpose") == 1, result.stdout
    assert "multigpu run: worker rank 1 (pid " in result.stdout and "exited with code 1" in result.stdout


def test_a_usage_error_in_the_script_is_one_sentence_and_exit_code_2(cluster: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = on_ray(cluster, "-n", "2", "--max-restarts", "1", str(script), "usage")
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stdout.splitlines() if not line.startswith("RANK=")]
    assert lines == ["multigpu: error: Rank one refuses this setting; pass another."], result.stdout  # no restart


def test_the_nanogpt_shaped_example_equals_its_multigpu_run(cluster: str, tmp_path: Path) -> None:
    args = ["--strategy", "zero3", "--max-iters", "2", "--eval-interval", "2", "--block-size", "32"]
    reference = run_reference(str(NANOGPT), [*args, "--out-dir", str(tmp_path / "reference")], timeout=180)
    result = on_ray(cluster, "-n", "2", str(NANOGPT), *args, "--out-dir", str(tmp_path / "ray"))
    assert result.returncode == 0, result.stdout
    assert val_losses(result.stdout) == val_losses(reference) and 2 in val_losses(reference), result.stdout


def test_verify_passes_on_ray(cluster: str) -> None:
    result = multigpu(
        "verify", "--ray", cluster, "--steps", "2", "--strategy", "ddp", "tests/scripts/next_token.py",
        env=QUIET, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0 and "PASS" in result.stdout, result.stdout


def test_a_killed_worker_restarts_everything_and_ends_with_the_uninterrupted_model(
    cluster: str, tmp_path: Path
) -> None:
    har = write_uci_har(tmp_path / "UCI HAR Dataset", {"train": 48, "test": 16}, {"train": [1, 3], "test": [2]})
    whole = tmp_path / "whole"
    run_reference("multigpu.recipes.train", train_args(har, whole, "--save-every", "2")[1:], timeout=180)
    killed = tmp_path / "killed"
    args = train_args(har, killed, "--nproc", "2", "--save-every", "2", "--max-restarts", "1", "--resume", "none")
    result = multigpu(*args, "--ray", cluster, env=QUIET | {"MULTIGPU_FAULT": "kill,step=3,rank=1"}, timeout=240)
    assert result.returncode == 0, result.stdout
    assert "multigpu run: worker rank 1 was killed by SIGKILL; restarting every worker (1 of 1)." in result.stdout
    assert f"resumed from {killed / 'checkpoints' / 'step-00000002'} at step 2" in result.stdout, result.stdout
    want, got = load_file(whole / "model.safetensors"), load_file(killed / "model.safetensors")
    assert all((got[name] == want[name]).all() for name in want)


def sentence(printed: str) -> str:
    assert printed.count("\n") == 1, printed
    return printed


def test_an_address_where_nothing_answers_is_one_sentence_quickly() -> None:
    started = time.monotonic()
    printed = sentence(refusal("run", "--ray", "127.0.0.1:1", "-n", "2", "-m", "multigpu.recipes.demo"))
    assert "Nothing answers at --ray 127.0.0.1:1 (Connection refused)" in printed
    assert time.monotonic() - started < 15


def test_without_ray_installed_it_says_how_to_install_it() -> None:
    with mock.patch.dict(sys.modules, {"ray": None}):
        printed = sentence(refusal("run", "--ray", "auto", "-n", "2", "-m", "multigpu.recipes.demo"))
    assert "Ray is not installed; pip install 'multigpu[ray]'." in printed


def test_more_than_the_cluster_has_is_one_sentence(cluster: str) -> None:
    printed = sentence(refusal("run", "--ray", cluster, "-n", "3", "-m", "multigpu.recipes.demo"))
    assert "need 3 CPUs and 0 GPUs, and the cluster at --ray" in printed and "has 2 CPUs and 0 GPUs" in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2", "--master-port", "29500"], "so --nnodes has no say; drop it."),
        (["--gpu-ids", "0"], "so --gpu-ids has no say; drop it."),
        (["--ray-gpus-per-worker", "2"], "--ray-gpus-per-worker must be 0 or 1 (got 2)"),
    ],
)
def test_what_ray_places_itself_is_refused(args: list[str], message: str) -> None:
    printed = sentence(refusal("run", "--ray", "127.0.0.1:1", *args, "-m", "multigpu.recipes.demo"))
    assert message in printed


def test_ray_sizes_without_ray_are_refused() -> None:
    printed = sentence(refusal("run", "--ray-cpus-per-worker", "2", "-m", "multigpu.recipes.demo"))
    assert "add --ray" in printed


def test_the_hosts_of_one_node_share_its_notes_and_the_last_to_read_finds_them_gone(tmp_path: Path) -> None:
    """Each worker's host reads and removes the node's notes folder as the run ends: the first takes every note,
    and one listing it as the first removes it finds it gone mid-listing (as scandir raises), which is no error."""
    from multigpu.launch.ray_host import WorkerHost

    (tmp_path / "rank1").write_text("stuck")
    assert WorkerHost().notes(str(tmp_path)) == {"rank1": "stuck"} and not tmp_path.exists()
    with mock.patch.object(Path, "glob", side_effect=FileNotFoundError(2, "No such file or directory")):
        assert WorkerHost().notes(str(tmp_path)) == {}
