"""Activation checkpointing computes what the plain forward and backward compute, bit for bit (the same kernels run
on the same inputs, once more), and each mode recomputes what it says it does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from multigpu.transforms.modules import default_units
from multigpu.transforms.recompute import MODES, recompute_blocks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # 2 heads
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        return x + F.dropout(F.gelu(self.out(attended)), 0.1, self.training)


class Tiny(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def step(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward and backward (dropout on) under `mode`: the loss, the gradients and the matmuls of backward."""
    torch.manual_seed(0)
    model, inputs = Tiny(), torch.randn(2, 6, 16)
    recompute_blocks(model, default_units(model), mode)
    torch.manual_seed(1)
    loss = model(inputs).square().mean()
    with CountMatmuls() as counted:
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, counted.count


def test_every_mode_computes_the_plain_loss_and_gradients_bit_for_bit() -> None:
    loss, grads, plain_matmuls = step("none")
    matmuls = {}
    for mode in MODES[1:]:
        found_loss, found_grads, matmuls[mode] = step(mode)
        assert torch.equal(found_loss, loss), mode
        assert found_grads.keys() == grads.keys()
        assert all(torch.equal(found_grads[name], grads[name]) for name in grads), mode
    # full runs each block's two linears again in backward; selective keeps their outputs; offload keeps all.
    assert matmuls == {"full": plain_matmuls + 2 * 3, "selective": plain_matmuls, "offload": plain_matmuls}


def test_the_blocks_keep_their_names_and_a_copy_recomputes_itself() -> None:
    model = Tiny()
    names = list(model.state_dict())
    recompute_blocks(model, default_units(model), "full")
    assert list(model.state_dict()) == names
    copied = copy.deepcopy(model)
    assert copied.layers[0].forward.__self__ is copied.layers[0]
    copied(torch.randn(1, 4, 16)).sum().backward()
    assert all(p.grad is not None for p in copied.parameters()) and all(p.grad is None for p in model.parameters())


def test_evaluation_and_none_leave_the_forward_alone() -> None:
    model = Tiny()
    recompute_blocks(model, default_units(model), "none")
    assert "forward" not in vars(model.layers[0])
    recompute_blocks(model, default_units(model), "selective")
    with torch.no_grad():
        assert model(torch.randn(1, 4, 16)).shape == (1, 4, 5)
    with pytest.raises(ValueError, match="unknown activation checkpointing mode"):
        recompute_blocks(model, default_units(model), "sometimes")


def test_a_hugging_face_decoder_recomputes_its_plain_gradients_with_its_cache_off() -> None:
    """A decoder fills its key/value cache in a training forward unless told not to; a recomputed layer would then
    add its keys to it twice (selective checkpointing raised: backward met other ops than the forward had run)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        recompute_blocks(model, model.model.layers, mode)
        assert model.config.use_cache == (mode == "none")
        model(input_ids=ids, labels=ids).loss.backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for mode in MODES[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"], strict=True)), mode
