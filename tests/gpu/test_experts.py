"""A mixture of experts (tiny-moe) on the GPU: the routers' token counts and load-balancing loss on CUDA tensors
(NCCL all-reduces them), LoRA on the experts, and with two GPUs the all-to-all dispatch of expert parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist import multigpu

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def finetune_args(tmp_path: Path) -> list[str]:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Line {i}: to be, or not to be." for i in range(300)))
    return ["-m", "multigpu.recipes.finetune", "--model", "tiny-moe", "--data", str(text), "--seq-len", "32"]


# fp32 (verify's bf16 bounds are for whole fine-tunes, not tiny models' updates): the experts' outputs are added
# back by index_add, whose CUDA atomics sum in any order (~1e-6 relative); a wrong scale or route moves far more.
FP32 = ["--precision", "32", "--loss-tolerance", "1e-4", "--param-tolerance", "0.02"]


@pytest.mark.parametrize("method", [["--method", "full"], ["--method", "lora", "--lora-experts"]])
def test_tiny_moe_trains_under_zero3_as_one_process_does(tmp_path: Path, method: list[str]) -> None:
    """verify: zero3 in one GPU process against the plain run, the load-balancing loss included."""
    recipe = [*finetune_args(tmp_path), *method, "--save-dir", str(tmp_path / "run")]
    args = ["verify", "--json", "--nproc", "1", "--strategy", "zero3", *FP32, "--steps", "4"]
    result = multigpu(*args, *recipe, timeout=300)
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert result.returncode == 0 and report["passed"], result.stdout


@two_gpus
def test_expert_parallelism_over_two_gpus_computes_what_one_does(tmp_path: Path) -> None:
    """The dispatch's all-to-alls over NCCL (counts, tokens, weights and back) and the experts' gradients."""
    recipe = [*finetune_args(tmp_path), "--method", "full", "--save-dir", str(tmp_path / "run")]
    args = ["verify", "--json", "--nproc", "2", "--strategy", "zero3", "--ep-size", "2", *FP32, "--steps", "4"]
    result = multigpu(*args, *recipe, timeout=300)
    report = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert result.returncode == 0 and report["passed"], result.stdout
