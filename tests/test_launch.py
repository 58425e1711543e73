"""`multigpu run` as a user runs it: real processes through torch.distributed.run."""

from __future__ import annotations

from pathlib import Path

from tests.dist import multigpu

SCRIPT = """
# A plain torch.distributed script, nothing of multigpu in it: it must run under `multigpu run` unchanged.
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of {world}, local {os.environ['LOCAL_RANK']}, sum {total.item():.0f}", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "fail" and rank == 1:
    raise RuntimeError("rank one broke on purpose")
if len(sys.argv) > 1 and sys.argv[1] == "exit3" and rank == 1:
    sys.exit(3)
dist.barrier()
dist.destroy_process_group()
"""


def write_script(tmp_path: Path) -> str:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def test_two_processes_get_ranks_zero_and_one(tmp_path: Path) -> None:
    result = multigpu("run", "-n", "2", write_script(tmp_path), timeout=90)
    assert result.returncode == 0, result.stdout
    assert "rank 0 of 2, local 0, sum 3" in result.stdout and "rank 1 of 2, local 1, sum 3" in result.stdout


def test_a_failing_worker_fails_the_run_with_its_traceback(tmp_path: Path) -> None:
    result = multigpu("run", "-n", "2", write_script(tmp_path), "fail", timeout=90)
    assert result.returncode == 1
    assert "RuntimeError: rank one broke on purpose" in result.stdout
    assert result.stdout.count("RuntimeError: rank one broke on purpose") == 1
    assert "multigpu run: worker rank 1 " in result.stdout  # the originator, not the peer that failed after it


def test_exit_code_is_the_failing_workers(tmp_path: Path) -> None:
    result = multigpu("run", "-n", "2", write_script(tmp_path), "exit3", timeout=90)
    assert result.returncode == 3, result.stdout


def test_gpu_ids_naming_absent_gpus_is_refused(tmp_path: Path) -> None:
    result = multigpu("run", "--gpu-ids", "0,1", write_script(tmp_path))
    assert result.returncode == 2
    assert "--gpu-ids 0,1 names GPUs that are not present" in result.stdout


RESTARTING = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} rank {dist.get_rank()}", flush=True)
if attempt == 0 and dist.get_rank() == 1:
    sys.exit(7)
dist.barrier()
dist.destroy_process_group()
"""


def test_max_restarts_restarts_every_worker_after_a_crash(tmp_path: Path) -> None:
    script = tmp_path / "restarting.py"
    script.write_text(RESTARTING)
    result = multigpu("run", "-n", "2", "--max-restarts", "1", str(script), timeout=120)
    assert result.returncode == 0, result.stdout
    assert "attempt 1 rank 0" in result.stdout and "attempt 1 rank 1" in result.stdout


KILLED = """
import os, signal, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
"""


def test_a_worker_killed_from_outside_is_named_not_its_peer(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    result = multigpu("run", "-n", "2", str(script), timeout=90)
    assert result.returncode == 128 + 9, result.stdout
    assert "multigpu run: worker rank 1 " in result.stdout and "killed by SIGKILL" in result.stdout
