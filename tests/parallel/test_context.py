"""Context parallelism's pieces: the head-and-tail slices of a batch, and Ulysses attention in 3 real processes
against one process's attention over the whole sequence (uneven heads, grouped-query heads, packed documents),
forward and backward. The whole fine-tunes under cp ride in tests/strategies/test_model_parallel.py's launches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.parallel.context import ContextParallel, head_split
from multigpu.parallel.context_attention import use_context_attention
from tests.dist import run_in_processes

CP = 3
# (heads, kv heads, packed): 6 and 3 divide by 3 (sent as they are, sdpa's grouped-query path); 4 heads do not (2, 1
# and 1 per rank) and their 2 kv heads are repeated to the 4 query heads first; 5 and 5 split 2, 2 and 1.
CASES = [(6, 3, False), (4, 2, True), (5, 5, True)]
LENGTH, DIM = 24, 8


def positions(packed: bool) -> torch.Tensor:
    """Two rows: whole sequences, or documents of 5, 11 and 8 tokens (and 24) packed with positions restarting."""
    if not packed:
        return torch.arange(LENGTH).expand(2, -1)
    first = torch.cat([torch.arange(5), torch.arange(11), torch.arange(8)])
    return torch.stack([first, torch.arange(LENGTH)])


def whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One process's attention: causal within each document; (batch, positions, heads, dim)."""
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    docs = starts.cumsum(1)
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=pos.device).tril()  # on the inputs' device
    mask = (docs[:, :, None] == docs[:, None, :]) & causal
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)


class OwnAttention(nn.Module):
    """Attention as a model of one's own writes it: F.scaled_dot_product_attention, causal."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, width))


class OwnModel(nn.Module):
    """Learnt positions looked up by position_ids, two attention blocks that cp_attention names, a head."""

    cp_attention = ("blocks.*",)

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.place = nn.Embedding(32, 16), nn.Embedding(LENGTH, 16)
        self.blocks = nn.ModuleList(OwnAttention(16, 4) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.place(position_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def compare_own_model(cp: ContextParallel) -> dict:
    """A model of one's own under cp against itself whole: logits of this rank's slice, and the gradients summed
    over the cp ranks."""
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    whole, ids = OwnModel(), torch.randint(0, 32, (2, LENGTH))
    logits = whole(ids, torch.arange(LENGTH).expand(2, -1))
    logits.square().sum().backward()
    split = copy.deepcopy(whole)
    split.zero_grad()
    use_context_attention(split, cp)
    inputs, _ = cp.split({"input_ids": ids}, None, positions=True)
    mine = split(**inputs)
    mine.square().sum().backward()
    for p in split.parameters():
        dist.all_reduce(p.grad)
    pairs = list(zip(whole.parameters(), split.parameters(), strict=True))
    # Relative to the largest gradient (the squared logits' sum makes them of order 100).
    grads = max((a.grad - b.grad).abs().max().item() for a, b in pairs) / max(
        a.grad.abs().max().item() for a, _ in pairs
    )
    return {"output": (mine - cp.local(logits)).abs().max().item(), "grads": grads, "scale": 1.0}


def compare_attention() -> list[dict]:
    """Each case on this rank: the largest differences of the output slice and of q, k, v's gradient slices from
    one process's whole computation (every rank computes that too, from the same seed)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cp = ContextParallel(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    found = []
    for heads, kv_heads, packed in CASES:
        torch.manual_seed(heads)
        q = torch.randn(2, heads, LENGTH, DIM, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, LENGTH, DIM, requires_grad=True) for _ in range(2))
        pos = positions(packed)
        whole = whole_attention(q, k, v, pos)
        weights = torch.randn_like(whole)
        (whole * weights).sum().backward()
        mine = [cp.local(t.detach(), 2).requires_grad_() for t in (q, k, v)]
        out = cp.attention(*mine, cp.local(pos), scaling=DIM**-0.5)
        (out * cp.local(weights)).sum().backward()
        found.append(
            {
                "output": (out - cp.local(whole)).abs().max().item(),
                "grads": max(
                    (m.grad - cp.local(t.grad, 2)).abs().max().item() for m, t in zip(mine, (q, k, v), strict=True)
                ),
                "scale": whole.abs().max().item(),
            }
        )
    return [*found, compare_own_model(cp)]


@pytest.fixture(scope="module")
def attention_ranks() -> list[list[dict]]:
    return run_in_processes("tests.parallel.test_context:compare_attention", CP, timeout=120)


@pytest.mark.parametrize("case", range(len(CASES) + 1))
def test_ulysses_attention_is_one_process_attention(attention_ranks: list[list[dict]], case: int) -> None:
    """The cases, and last a model of one's own whose attention modules cp_attention names."""
    # fp32: each head's attention is the same sums over the same keys, only in sdpa's own blocking (a mask or
    # is_causal): ~1e-7 of values of order 1; a key from another document or a misplaced chunk differs by 1e-1.
    for rank in attention_ranks:
        assert rank[case]["output"] < 1e-5 * rank[case]["scale"]
        assert rank[case]["grads"] < 1e-5


def test_each_rank_keeps_a_head_and_a_tail_chunk() -> None:
    batch = torch.arange(16).view(1, 16)
    slices = [ContextParallel(None, 2, rank).local(batch) for rank in range(2)]
    assert slices[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert slices[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert head_split(9, 2) == [5, 4] and head_split(4, 3) == [2, 1, 1]


def test_split_gives_positions_and_drops_right_padding() -> None:
    cp = ContextParallel(None, 2, 1)
    ids = torch.arange(16).view(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    inputs, labels = cp.split({"input_ids": ids, "attention_mask": mask, "use_cache": False}, ids + 1, positions=True)
    assert set(inputs) == {"input_ids", "position_ids", "use_cache"}
    assert inputs["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert labels.tolist() == [[3, 4, 5, 6], [11, 12, 13, 14]]


def test_split_refuses_what_it_cannot_cut() -> None:
    cp = ContextParallel(None, 2, 0)
    with pytest.raises(UsageError, match=r"2 x cp_size = 4 equal chunks, and this batch's sequences are 6 long"):
        cp.split({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, None, positions=True)
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(UsageError, match=r"masks tokens before real ones; pad on the right"):
        cp.split({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": left}, None, positions=True)
