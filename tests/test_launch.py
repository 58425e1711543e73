"""`multigpu run` as a user runs it: real processes through torch.distributed.run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import multigpu.launch as launching
from multigpu.errors import UsageError
from multigpu.launch import LaunchConfig
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


ENDING = """
import atexit, sys, threading, time
log = open(sys.argv[1], "w")
log.write("written, never closed\\n")  # only a flush at exit puts this on disk
atexit.register(lambda: print("the script's exit handler ran", flush=True))
# A thread still busy in Python when the script ends: the interpreter's teardown is where such threads race.
threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(int, 1)], daemon=True).start()
if sys.argv[2] == "raise":
    raise RuntimeError("failed on purpose")
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize(("how", "code"), [("0", 0), ("5", 5), ("raise", 1)])
def test_a_worker_ends_with_its_scripts_code_and_output_once_its_exit_handlers_ran(
    tmp_path: Path, how: str, code: int
) -> None:
    """Workers end the process themselves after the exit handlers (multigpu.worker), skipping the interpreter's
    teardown: nothing the script wrote or printed may be lost on the way, nor its exit code."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    result = multigpu("run", "-n", "1", str(script), str(tmp_path / "log.txt"), how, timeout=60)
    assert result.returncode == code, result.stdout
    assert "the script's exit handler ran" in result.stdout
    assert (tmp_path / "log.txt").read_text() == "written, never closed\n"
    assert ("RuntimeError: failed on purpose" in result.stdout) == (how == "raise")


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


# GPU selection, with the GPU count and CUDA_VISIBLE_DEVICES passed in: these run on machines without GPUs.


def test_gpu_ids_index_the_gpus_cuda_visible_devices_already_exposes() -> None:
    assert launching.select_gpus(LaunchConfig(gpu_ids="1"), 2, "2,3") == (1, "3")
    assert launching.select_gpus(LaunchConfig(gpu_ids="1,0"), 2, "GPU-aaaa,GPU-bbbb") == (2, "GPU-bbbb,GPU-aaaa")
    assert launching.select_gpus(LaunchConfig(gpu_ids="0"), 1, "MIG-GPU-aaaa/1/0") == (1, "MIG-GPU-aaaa/1/0")
    assert launching.select_gpus(LaunchConfig(gpu_ids="0,3"), 4, None) == (2, "0,3")  # unset: physical indices
    assert launching.select_gpus(LaunchConfig(), 2, "2,3") == (2, None)  # no --gpu-ids: the variable stays
    with pytest.raises(UsageError, match=r"--gpu-ids 2 names GPUs that are not present \(CUDA_VISIBLE_DEVICES=2,3"):
        launching.select_gpus(LaunchConfig(gpu_ids="2"), 2, "2,3")


def test_more_processes_than_gpus_is_refused_but_not_on_cpu() -> None:
    with pytest.raises(UsageError, match=r"^--nproc 4 .* 2 GPUs .*; pass --nproc 2 or fewer"):
        launching.select_gpus(LaunchConfig(nproc=4), 2, None)
    with pytest.raises(UsageError, match=r"^--nproc 3 .* 2 GPUs --gpu-ids 0,1 names, .*; pass --nproc 2 or fewer"):
        launching.select_gpus(LaunchConfig(nproc=3, gpu_ids="0,1"), 4, None)
    assert launching.select_gpus(LaunchConfig(nproc=1, gpu_ids="0,1"), 2, None) == (1, "0,1")
    assert launching.select_gpus(LaunchConfig(nproc=4), 0, None) == (4, None)  # CPU processes
    assert launching.select_gpus(LaunchConfig(), 0, None) == (1, None)


def test_launch_gives_the_workers_the_gpu_the_user_meant(monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launching, "torch_run", lambda args: started.append((args.nproc_per_node, os.environ.copy())))
    # launch() writes the environment; a copy keeps that from leaking into other tests.
    monkeypatch.setattr(os, "environ", {**os.environ, "CUDA_VISIBLE_DEVICES": "2,3"})
    assert launching.launch(LaunchConfig(gpu_ids="1"), ["script.py"]) == 0
    [(nproc, environ)] = started
    assert nproc == "1" and environ["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(UsageError, match="--nproc 4"):
        launching.launch(LaunchConfig(nproc=4), ["script.py"])
    assert len(started) == 1  # refused before any process started


# The NCCL watchdog's flight-recorder dumps, written here in torch's format: NCCL itself needs GPUs.


def trace_entry(seq: int, name: str, state: str = "completed", group: str = "0") -> dict:
    return {"process_group": (group, "default_pg"), "collective_seq_id": seq, "profiling_name": name, "state": state}


def write_traces(directory: Path, entries_per_rank: dict[int, list[dict]]) -> None:
    import pickle

    from multigpu.progress import NCCL_TRACE_PREFIX

    for rank, entries in entries_per_rank.items():
        dump = {"version": "2.10", "pg_config": {}, "entries": entries}
        (directory / f"{NCCL_TRACE_PREFIX}{rank}").write_bytes(pickle.dumps(dump))


def test_the_nccl_traces_name_the_rank_that_never_reached_the_collective(tmp_path: Path) -> None:
    from multigpu.progress import explain_nccl_timeout, read_nccl_traces

    done = [trace_entry(1, "nccl:broadcast"), trace_entry(2, "nccl:all_reduce")]
    waiting = [*done, trace_entry(3, "nccl:_reduce_scatter_base", state="started")]
    write_traces(tmp_path, {0: waiting, 1: done, 2: waiting})
    message = explain_nccl_timeout(read_nccl_traces(tmp_path))
    assert message.startswith("NCCL timed out: rank(s) 1 never reached collective 3 (nccl:_reduce_scatter_base)")
    assert "rank(s) 0, 2 waited; the last one they reached was 2 (nccl:all_reduce)" in message
    write_traces(tmp_path, {0: waiting, 1: waiting, 2: waiting})
    everyone = explain_nccl_timeout(read_nccl_traces(tmp_path))
    assert "every rank entered collective 3 (nccl:_reduce_scatter_base)" in everyone and "never completed" in everyone


def test_on_gpus_the_workers_record_collectives_and_dump_them_on_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from multigpu.progress import NCCL_TRACE_PREFIX

    started = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launching, "torch_run", lambda args: started.append(os.environ.copy()))
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")})
    launching.launch(LaunchConfig(nproc=2), ["script.py"])
    [environ] = started
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(environ["TORCH_FR_BUFFER_SIZE"]) > 0
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(Path(environ["MULTIGPU_EXIT_DIR"]) / NCCL_TRACE_PREFIX)
