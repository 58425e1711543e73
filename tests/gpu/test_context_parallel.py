"""Context parallelism on CUDA: Ulysses' all-to-alls and document mask on NCCL and the GPU's attention kernels, and
torch's ring attention (cp_method ring), which runs on CUDA only. cp needs a process per slice, each on a GPU of its
own, so the fine-tunes need 2 GPUs; one GPU checks the attention in a group of one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist import run_in_processes
from tests.parallel.test_context import LENGTH, positions, whole_attention
from tests.recipes.test_finetune import write_chat, write_text

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def ulysses_on_one_gpu() -> float:
    """Ulysses attention in a NCCL group of one, bf16, packed documents: its largest difference from the plain
    computation, relative to the output's largest value."""
    import torch.distributed as dist

    from multigpu.parallel.context import ContextParallel

    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    cp = ContextParallel(dist.group.WORLD, 1, 0)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, LENGTH, 8, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    pos = positions(packed=True).cuda()
    whole = whole_attention(q, k, v, pos)
    out = cp.attention(q, k, v, pos, scaling=8**-0.5)
    return ((out - whole).abs().max() / whole.abs().max()).item()


def test_ulysses_attention_runs_on_the_gpu() -> None:
    (difference,) = run_in_processes("tests.gpu.test_context_parallel:ulysses_on_one_gpu", 1, timeout=300)
    assert difference < 2e-2  # bf16: 8 bits of mantissa, two kernels that round in different places


@two_gpus
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_a_fine_tune_under_cp_on_two_gpus_lands_on_one_gpu(tmp_path: Path, method: str) -> None:
    """The tiny Llama, fp32, 4 steps: cp 2 (each GPU half of every sequence) against one GPU. Ring merges each
    block's softmax in another order: 1e-4, the model-parallel layouts' bound."""
    write_text(tmp_path / "text.txt")
    write_chat(tmp_path / "chat.jsonl")
    target = "tests.strategies.test_model_parallel:run_cells"
    (one,) = run_in_processes(
        target, 1, timeout=600, workdir=str(tmp_path), runs=[("one", {"multi_gpu": "single"})], demos=[]
    )
    settings = {"multi_gpu": "ddp", "cp_size": 2, "cp_method": method}
    split = run_in_processes(target, 2, timeout=600, workdir=str(tmp_path), runs=[("cp", settings)], demos=[])[0]
    assert split["cp"]["val_loss"] == pytest.approx(one["one"]["val_loss"], rel=1e-4)
