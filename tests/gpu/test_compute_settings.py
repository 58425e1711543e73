"""Issue 31's compute settings on one GPU, each against the plain path: compile, activation checkpointing, float8,
the chunked and fused losses, and Liger-Kernel's fused layers, on a small Hugging Face Llama through the Engine.

Only one GPU is lent to these checks, so nothing here compares 1 GPU with 2: the 1-vs-N matrix of each setting runs
on the CPU with gloo (tests/recipes). Gradient compression, which needs a process group, is in
test_grad_compression.py. Tolerances: fp32 compares kernels that sum in another order (about 1e-6 relative per op),
so a few steps stay within 1e-4; a wrong formula moves the first loss by more than 1e-2. (TF32 is off: torch's
default, which the Engine leaves, and inductor's warning on the GPU says so.)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.core.errors import UsageError
from multigpu.recipes.finetune import lm_loss

SMALL = {
    "vocab_size": 1024,
    "hidden_size": 256,  # every linear's dimensions multiples of 16, as float8's kernels need
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# For the checkpointing memory test: the blocks' activations (8 layers x 4096 tokens x some 20 tensors of 256 to
# 512 values) far above the logits outside the blocks (4096 x 512), which every mode keeps alike.
DEEP = {"shape": {**SMALL, "num_hidden_layers": 8, "vocab_size": 512}, "batch": 8, "seq": 512}
# A vocabulary whose logits (4 x 512 x 32768 fp32: 256 MiB, and as much again for their gradient) outweigh the rest.
LARGE_VOCAB = {**SMALL, "vocab_size": 32768}
# What fp32 gradients that summed in another order may differ by, as a share of the tensor's largest gradient: an
# element's rounding error follows the size of the terms summed into it, not of their sum, so an element that is a
# small sum of large terms (a cancellation) differs by as much as a large one, and a relative bound alone fails it.
# Seen on an H200 (one run each): up to 5.4e-6 (offload, embed_tokens), 2.1e-6 (liger, o_proj), 1.6e-6 (compile,
# lm_head), in one to 75 elements of 65536 to 262144, where those tensors' largest gradients are 2e-2 to 4e-2 (this
# model on the CPU): about 1e-4 of the largest. 1e-3 of it leaves room for other runs and cards, and still fails a
# gradient scaled wrong (x2, or x1.01) at its largest elements. The 1e-6 floor, which they met under compile there,
# is for the small query and key gradients (largest about 5e-4), where softmax's backward cancels the most.
GRAD_NOISE, GRAD_FLOOR = 1e-3, 1e-6


def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


@dataclass
class Run:
    losses: list[float]  # the mean token loss of each step
    grads: dict[str, torch.Tensor]  # after the first backward, on the CPU in fp32
    activation_bytes: int  # the second step's forward and backward: the allocator's peak above its start
    graphs: list[int] = field(default_factory=list)  # torch.compile's graphs so far, after each step
    model: Any = None


def llama(shape: dict[str, int]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # every run starts from the same weights
    return LlamaForCausalLM(LlamaConfig(**shape, use_cache=False, tie_word_embeddings=False))


def train(
    settings: dict[str, Any],
    precision: str = "32",
    steps: int = 3,
    shape: dict[str, int] = SMALL,
    batch: int = 4,
    seq: int = 128,
) -> Run:
    """`steps` AdamW steps of a small Llama on one fixed batch (so the loss falls), through the Engine, with the
    loss function of its `loss` setting (engine.lm_loss, as the fine-tune recipe takes it)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine = mg.Engine(strategy="single", precision=precision, seed=0, **settings)
    with engine.init_module():
        model = llama(shape)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss_fn = lm_loss(engine, model)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(engine.device)
    labels = torch.roll(ids, -1, dims=1)  # each token's next one: what the model learns over the steps
    run = Run([], {}, 0, model=model)
    on_gpu = engine.device.type == "cuda"
    for step in range(steps):
        if step == 1 and on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        loss = engine.forward_backward(model, {"input_ids": ids}, labels, loss_fn)
        if step == 1 and on_gpu:
            run.activation_bytes = torch.cuda.max_memory_allocated() - start
        if step == 0:
            run.grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        engine.step(optimizer)
        run.losses.append(float(loss) / labels.numel())
        run.graphs.append(counters["stats"]["unique_graphs"])
    return run


def assert_same_training(run: Run, plain: Run, rtol: float) -> None:
    """The same losses within `rtol`; the same first gradients within `rtol` of each element and GRAD_NOISE of the
    tensor's largest gradient (AdamW's update hardly changes with the gradients' scale: the losses alone would pass a
    gradient scaled wrong)."""
    assert run.grads.keys() == plain.grads.keys()
    torch.testing.assert_close(run.losses, plain.losses, rtol=rtol, atol=0)
    for name, expected in plain.grads.items():
        atol = max(GRAD_FLOOR, GRAD_NOISE * expected.abs().max().item())
        torch.testing.assert_close(run.grads[name], expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_blocks_train_as_eager_and_compile_once() -> None:
    plain, compiled = train({}), train({"compile": True})
    assert_same_training(compiled, plain, rtol=1e-4)  # inductor's fused fp32 kernels sum in their own order
    assert compiled.graphs[0] >= 1, "compile=True compiled nothing"
    assert compiled.graphs[-1] == compiled.graphs[0], f"recompiled after the first step: {compiled.graphs}"
    assert all(b._compiled_call_impl is not None for b in compiled.model.model.layers)


@pytest.mark.parametrize("mode", ["full", "selective", "offload"])
def test_each_checkpointing_mode_trains_as_plain(mode: str) -> None:
    # Recomputation runs the same kernels on the same inputs, and offload hands backward contiguous copies of the
    # saved tensors (torch's save_on_cpu), which its kernels may tile otherwise: attention's backward, which adds
    # with atomics, and the products may add in another order.
    assert_same_training(train({"activation_checkpointing": mode}), train({}), rtol=1e-5)


def test_checkpointing_keeps_less_on_the_gpu_than_none() -> None:
    peaks = {
        mode: train({"activation_checkpointing": mode}, "bf16-mixed", steps=2, **DEEP).activation_bytes
        for mode in ("none", "full", "selective", "offload")
    }
    # none keeps about twenty tensors per layer and token, full its block inputs alone (one per layer) and one
    # block's worth while it recomputes, offload everything in host memory: far under half.
    assert peaks["full"] < 0.5 * peaks["none"], peaks
    assert peaks["offload"] < 0.5 * peaks["none"], peaks
    assert peaks["selective"] < peaks["none"], peaks  # the matrix products' outputs, not the element-wise ops'


@needs_torchao
@pytest.mark.skipif(capability() < (8, 9), reason="float8 needs compute capability 8.9 or newer")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_converts_the_blocks_linears_and_trains_close_to_bf16(recipe: str) -> None:
    plain, run = train({}, "bf16-mixed", steps=5), train({"float8": recipe}, "bf16-mixed", steps=5)
    converted = [name for name, m in run.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == 7 * SMALL["num_hidden_layers"], converted  # q k v o gate up down of every layer
    assert type(run.model.lm_head) is nn.Linear  # the output head stays in bf16
    assert run.losses[-1] < run.losses[0], run.losses
    # Measured in torchao's emulation on the CPU (the same model, data and steps): at most 0.4% (tensorwise) and
    # 0.8% (rowwise) from bf16 over 5 steps; 3% leaves room for the GPU's kernels and stops a wrong scale (x2).
    torch.testing.assert_close(run.losses, plain.losses, rtol=3e-2, atol=0)


@pytest.mark.skipif(capability() >= (8, 9), reason="this GPU runs float8")
def test_float8_is_refused_on_a_gpu_older_than_compute_capability_8_9() -> None:
    with pytest.raises(UsageError, match=r"8\.9"):
        train({"float8": "tensorwise"}, "bf16-mixed", steps=1)


@pytest.mark.parametrize("loss", ["chunked", pytest.param("fused", marks=needs_liger)])
def test_a_loss_without_the_whole_logits_matches_plain_and_keeps_less(loss: str) -> None:
    plain = train({}, steps=2, shape=LARGE_VOCAB, batch=4, seq=512)
    run = train({"loss": loss}, steps=2, shape=LARGE_VOCAB, batch=4, seq=512)
    assert_same_training(run, plain, rtol=1e-4)  # the same fp32 sums, taken a slice of tokens at a time
    # plain holds the logits, their fp32 log-softmax and gradient (3 x 256 MiB); the others a slice at a time.
    assert run.activation_bytes < 0.5 * plain.activation_bytes, (run.activation_bytes, plain.activation_bytes)


@needs_liger
def test_liger_replaces_the_decoder_s_layers_and_trains_as_plain() -> None:
    plain, run = train({}), train({"liger": True})
    patched = [
        name
        for name, m in run.model.named_modules()
        if "liger_kernel" in (getattr(type(m), "__module__", "") + getattr(m.forward, "__module__", ""))
    ]
    assert patched, "liger=True replaced no module's forward with Liger-Kernel's"
    assert_same_training(run, plain, rtol=1e-3)  # Triton fp32 kernels (RMSNorm, RoPE, SwiGLU), fused
