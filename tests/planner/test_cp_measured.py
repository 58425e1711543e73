"""The planner's cp figures against what one cp rank's autograd really keeps, in one process: the tiny Llama runs
one rank's positions, and its attention is replaced by Ulysses with the all-to-alls stood in for by functions that
save nothing (as the collectives do) and hand back tensors of the shapes and sizes the other ranks would send."""

from __future__ import annotations

import pytest
import torch

from multigpu.planner.activations import transformer_activations
from multigpu.planner.shapes import from_config
from multigpu.transforms.recompute import recompute_blocks
from tests.planner.test_measured import TINY_LLAMA, saved_bytes

transformers = pytest.importorskip("transformers")
STAND_IN = "ulysses_stand_in"


class ToHeads(torch.autograd.Function):
    """(B, heads, S/cp, D) -> (B, heads/cp, S, D): this rank's heads over the whole sequence, the other ranks'
    positions arriving as fresh tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: int) -> torch.Tensor:
        ctx.cp = cp
        b, heads, s, d = x.shape
        local = -(-heads // cp)
        others = [x.new_zeros(b, local, s, d) for _ in range(cp - 1)]
        return torch.cat([x[:, :local], *others], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        b, local, s, d = grad.shape
        back = grad.new_zeros(b, local * ctx.cp, s // ctx.cp, d)
        back[:, :local] = grad[:, :, : s // ctx.cp]
        return back, None


class ToPositions(torch.autograd.Function):
    """(B, heads/cp, S, D) -> (B, heads, S/cp, D): attention's output back at this rank's positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: int, heads: int) -> torch.Tensor:
        ctx.cp = cp
        b, local, s, d = x.shape
        out = x.new_zeros(b, heads, s // cp, d)
        out[:, :local] = x[:, :, : s // cp]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ToHeads.apply(grad, ctx.cp), None, None


def ulysses(cp: int):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        heads = query.shape[1]
        if key.shape[1] % cp:  # key/value heads cp does not divide: repeated to the query heads first
            key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
        q, k, v = (ToHeads.apply(t, cp) for t in (query, key, value))
        gqa = k.shape[1] != q.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return ToPositions.apply(out, cp, heads).transpose(1, 2).contiguous(), None

    return attention


def rank_model(cp: int, checkpointing: str) -> torch.nn.Module:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(STAND_IN, ulysses(cp))
    AttentionMaskInterface.register(STAND_IN, sdpa_mask)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA, attn_implementation=STAND_IN)
    model = transformers.LlamaForCausalLM(config)
    recompute_blocks(model, model.model.layers, checkpointing)
    return model.train()


def rank_batch(batch: int, seq: int, cp: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (batch, seq // cp))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq // cp).expand(batch, -1)}


def peak_activations(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """Everything but parameters and gradients at a step's peak, once the gradients exist (test_measured's way)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model(**inputs).loss.backward()
    model.zero_grad(set_to_none=False)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(**inputs).loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    held = sum(value for kind, value in peak.items() if kind != "Total" and kind.value in ("Parameter", "Gradient"))
    return peak["Total"] - held


# cp 4 does not divide the tiny Llama's 2 key/value heads: they are repeated, as the runtime does.
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_one_cp_ranks_activations_are_the_planned_ones(cp: int, checkpointing: str) -> None:
    """Saved bytes within 15% (the issue's bar; they agree within 1%), and the peak within 15% (0.99 to 1.11 of
    the measured one: the planner takes Ulysses' gathered gradients and their copies as alive together, an upper
    bound)."""
    t = from_config(TINY_LLAMA, "tiny").transformer
    model, inputs = rank_model(cp, checkpointing), rank_batch(4, 128, cp)
    planned = transformer_activations(t, 4, 128, "32", checkpointing, cp)
    if checkpointing != "selective":  # selective keeps its products in a cache no saved-tensor hook sees
        assert planned.saved == pytest.approx(saved_bytes(model, lambda: model(**inputs)), rel=0.15)
    assert planned.peak == pytest.approx(peak_activations(model, inputs), rel=0.15)
