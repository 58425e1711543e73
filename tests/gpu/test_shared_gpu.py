"""Several processes on one GPU (`--share-gpus`), talking over gloo: the multi-process GPU paths (every tensor on
`engine.device`, each strategy's collectives on CUDA tensors) run on a machine with a single GPU, each layout that
gloo can carry checked by `multigpu verify` against one process on the same GPU, the others refused by name.

Measured on an H200 (torch 2.11): gloo's all-reduce, broadcast and all-to-all take CUDA tensors; its all-gather
(DTensor's full_tensor, FSDP2's unsharding) ends the process with a segmentation fault, and its send (pipeline
stages) aborts with "Bad address" (docs/strategies.md, "One GPU, several processes")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist import multigpu
from tests.recipes.test_finetune import write_text

# fp32 on both sides: the two runs differ only in how the batch is split and summed (and in CUDA's atomics, which
# sum in any order: ~1e-6 relative); a wrong scale, route or missing reduction moves the loss far more.
FP32 = ["--precision", "32", "--loss-tolerance", "1e-4", "--param-tolerance", "0.02", "--steps", "4"]
SCRIPT = ["tests/scripts/next_token.py", "--epochs", "2"]

RUNS = {
    "ddp": ["--strategy", "ddp"],
    "zero1": ["--strategy", "zero1"],
    "ddp-shares-3-1": ["--strategy", "ddp", "--batch-shares", "3,1"],
    "ddp-shares-auto": ["--strategy", "ddp", "--batch-shares", "auto"],
}
REFUSED = {
    "zero3": (["--multi-gpu", "zero3"], "strategy zero3"),
    "tp": (["--multi-gpu", "tp"], "strategy tp with tp_size 2"),
    "pp": (["--multi-gpu", "pp"], "strategy pp with pp_size 2"),
    "ep": (["--model", "tiny-moe", "--multi-gpu", "ddp", "--ep-size", "2"], "ep_size 2"),
}


def verify(layout: list[str], target: list[str]) -> None:
    result = multigpu("verify", "--share-gpus", "--json", "--nproc", "2", *FP32, *layout, *target, timeout=300)
    assert "{\n" in result.stdout, result.stdout
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert result.returncode == 0 and report["passed"], result.stdout


def test_auto_shares_time_the_gpu_with_cuda_events() -> None:
    """batch_shares auto's probe on a GPU: 4 products of 4096-square bf16 matrices, about 0.55 TFLOP, timed with
    CUDA events (well under a second on any GPU that runs bf16)."""
    import torch

    from multigpu.core.compute_clock import probe_s

    seconds = probe_s(torch.device("cuda"))
    assert 0 < seconds < 1


@pytest.mark.parametrize("name", RUNS)
def test_two_processes_on_one_gpu_compute_what_one_process_does(name: str) -> None:
    verify(RUNS[name], SCRIPT)


def test_context_parallelism_on_one_shared_gpu(tmp_path: Path) -> None:
    """Ulysses' all-to-alls on CUDA tensors through gloo, on the tiny Llama."""
    data = write_text(tmp_path / "text.txt")
    recipe = ["-m", "multigpu.recipes.finetune", "--model", "tiny", "--data", data, "--seq-len", "32"]
    verify(["--strategy", "ddp", "--cp-size", "2"], [*recipe, "--method", "full", "--save-dir", str(tmp_path / "r")])


@pytest.mark.parametrize("name", REFUSED)
def test_what_gloo_cannot_carry_on_cuda_is_refused_before_the_launch(tmp_path: Path, name: str) -> None:
    layout, needs = REFUSED[name]
    args = ["finetune", "--share-gpus", "--nproc", "2", "--data", write_text(tmp_path / "text.txt"), *layout]
    result = multigpu(*args, "--save-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2, result.stdout
    assert f"talk over gloo, whose all-gathers and sends crash on CUDA tensors, and {needs} needs them" in result.stdout


def test_nccl_on_a_shared_gpu_is_one_sentence(tmp_path: Path) -> None:
    """Two ranks on one GPU make NCCL fail on a duplicate device at its first collective; asked for by name, it is
    refused before the process group is made."""
    script = tmp_path / "nccl.py"
    script.write_text("import multigpu as mg\nmg.Engine(strategy='ddp', backend='nccl')\n")
    result = multigpu("run", "--share-gpus", "-n", "2", str(script), timeout=120)
    assert result.returncode != 0
    assert "processes share this node's 1 GPU(s), and NCCL refuses two ranks on one GPU" in result.stdout
