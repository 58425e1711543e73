"""The loss modes on a GPU: chunked and Liger-Kernel's fused loss against the plain one, and Liger's layers in a
Hugging Face decoder (skipped without CUDA; the fused and Liger tests also without liger-kernel installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from multigpu.transforms.loss import apply_liger, linear_cross_entropy
from tests.dist import multigpu
from tests.transforms.test_loss import VOCAB, inputs, tiny_llama

needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")


def losses_and_gradients(mode: str, autocast: bool) -> list[torch.Tensor]:
    hidden, weight, targets = (t.detach().cuda().requires_grad_(t.is_floating_point()) for t in inputs(tokens=1000))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss, count = linear_cross_entropy(hidden, weight, targets, mode=mode, chunk_tokens=96)
    assert count == (targets != -100).sum()
    return [loss, *torch.autograd.grad(loss, [hidden, weight])]


@pytest.mark.parametrize("mode", ["chunked", pytest.param("fused", marks=needs_liger)])
@pytest.mark.parametrize("autocast", [False, True])
def test_each_mode_computes_the_plain_loss_on_the_gpu(mode: str, autocast: bool) -> None:
    # fp32: TF32 may round the products (torch's default leaves matmul in full fp32, Liger's kernels may not);
    # bf16 autocast rounds them to 8 bits, grouped differently per mode.
    bound = 1e-2 if autocast else 1e-3
    for plain, found in zip(losses_and_gradients("plain", autocast), losses_and_gradients(mode, autocast), strict=True):
        assert found.dtype == plain.dtype
        assert (found - plain).abs().max() <= bound * plain.abs().max()


@needs_liger
def test_liger_layers_compute_what_the_decoder_computes() -> None:
    model = tiny_llama().cuda()
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    with torch.no_grad():
        before = model(input_ids=ids).logits
        apply_liger(model)
        after = model(input_ids=ids).logits
    assert model.model.norm.forward.__func__.__qualname__ == "LigerRMSNorm.forward"  # bound on the instance
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)


@needs_liger
def test_finetune_with_the_fused_loss_and_liger(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Line {i}: to be, or not to be." for i in range(300)))
    args = ["finetune", "--model", "tiny", "--data", str(text), "--method", "full", "--precision", "bf16-mixed"]
    args += ["--seq-len", "32", "--max-steps", "4", "--save-dir", str(tmp_path / "run"), "--log-every", "0"]
    result = multigpu(*args, "--loss", "fused", "--liger", timeout=300)
    assert result.returncode == 0, result.stdout
    assert "step 4: validation loss" in result.stdout
