"""Compressed gradient communication on NCCL, in a process group of one (one GPU is what these checks are lent; the
1-vs-N comparison runs on the CPU with gloo): ddp's bf16 and fp16 hooks and zero2's bf16 reduce dtype.

In a group of one the reduction adds nothing, so what is left of the compression is its rounding: every gradient
that went through a bf16 (fp16) collective is a value that bf16 (fp16) can hold, which a plain fp32 gradient almost
never is. That tells, on one GPU, whether the compressed path ran at all.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu as mg
from tests.dist import run_each_in_processes
from tests.reference import TinyNet, dataset

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [("ddp", "none"), ("ddp", "bf16"), ("ddp", "fp16"), ("zero2", "none"), ("zero2", "bf16")]


def compressed_step(strategy: str, compression: str) -> dict:
    """One backward under `compression`: which dtypes hold every gradient exactly, and two steps' losses."""
    engine = mg.Engine(strategy=strategy, precision="32", seed=0, grad_compression=compression)
    model = TinyNet()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses, exact_in = [], {}
    for step, (x, y) in enumerate(engine.dataloader(dataset(16), batch_size=8, shuffle=False)):
        loss = engine.forward_backward(model, x, y, nn.functional.cross_entropy)
        if step == 0:
            grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
            exact_in = {name: all(torch.equal(g, g.to(dtype).float()) for g in grads) for name, dtype in DTYPES.items()}
        engine.step(optimizer)
        losses.append(float(loss))
    return {"backend": str(torch.distributed.get_backend()), "exact_in": exact_in, "losses": losses}


def test_compressed_gradients_are_rounded_to_their_dtype_on_nccl() -> None:
    calls = [{"strategy": strategy, "compression": compression} for strategy, compression in CASES]
    (results,) = run_each_in_processes("tests.gpu.test_grad_compression:compressed_step", 1, calls, timeout=300)
    by_case = dict(zip(CASES, results, strict=True))
    for (strategy, compression), result in by_case.items():
        assert "nccl" in result["backend"], result
        # Rounded to bf16, a gradient keeps 8 significant bits, to fp16 11: fp16's are not bf16 values. (A bf16
        # value may well be an fp16 one too, so that direction tells nothing.)
        if compression == "none":
            assert not any(result["exact_in"].values()), (strategy, result["exact_in"])
        else:
            assert result["exact_in"][compression], (strategy, compression, result["exact_in"])
        if compression == "fp16":
            assert not result["exact_in"]["bf16"], (strategy, result["exact_in"])
        plain = by_case[(strategy, "none")]["losses"]
        # The first loss precedes any update; the second follows one step on gradients rounded to 8 (bf16) or 11
        # (fp16) significant bits, relative error up to 2**-8: the loss moves by far less than 1%.
        assert result["losses"][0] == plain[0], (strategy, compression)
        assert result["losses"][1] == pytest.approx(plain[1], rel=1e-2), (strategy, compression)
