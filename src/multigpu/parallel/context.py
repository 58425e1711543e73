"""Context parallelism: each sequence of a batch split by position over the cp ranks of a replica, which read the
same batch and each keep their own slice of it from the embedding to the loss.

The sequence is cut into 2 x cp chunks and rank r keeps chunks r and 2cp-1-r (a head and a tail), so under causal
attention every rank has the same work. Only attention needs the whole sequence. Ulysses (DeepSpeed's method) gets
it there by one all-to-all per tensor: q, k and v go from (batch, all heads, this rank's positions) to (batch, this
rank's heads, every position), attention runs over the whole sequence in its original order, and its output goes
back the same way. Heads that do not divide by cp are split unevenly (all_to_all_single takes uneven sizes), the
key/value heads of grouped-query attention repeated to the query heads when they do not divide.

Packed documents keep their boundaries: the position_ids (restarting at 0 per document) are split with the tokens,
gathered back inside attention, and a document mask built from them, so the split run attends exactly as one
process does. Right padding needs no mask under causal attention (no real token attends to a later one), so the
batch's attention_mask is checked to be right padding and left out.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from multigpu.config.layout import cp_chunks
from multigpu.core.errors import UsageError

#: torch's own attention, which a module that cp_attention names sees replaced by Ulysses' while it runs.
TORCH_SDPA = F.scaled_dot_product_attention


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 with its backward: the same exchange with the sizes swapped. `send` and
    `receive` count units of `unit` rows (default: x's rows over what it sends; a rank may send nothing)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], receive: list[int], group: Any, unit: int | None = None
    ) -> torch.Tensor:
        unit = unit or x.shape[0] // sum(send)
        ctx.send, ctx.receive, ctx.group, ctx.unit = send, receive, group, unit
        out = x.new_empty((sum(receive) * unit, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), [n * unit for n in receive], [n * unit for n in send], group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _AllToAll.apply(grad, ctx.receive, ctx.send, ctx.group, ctx.unit), None, None, None, None


def head_split(heads: int, cp: int) -> list[int]:
    """How many of `heads` each of the `cp` ranks attends with: as even as can be, the first ranks one more."""
    return [heads // cp + (rank < heads % cp) for rank in range(cp)]


def check_heads(heads: int, cp: int) -> None:
    """Refuses a Ulysses layout that would leave a rank without a whole attention head."""
    if heads < cp:
        raise UsageError(
            f"cp_method ulysses gives each of the cp_size {cp} ranks whole attention heads, and this model has "
            f"{heads}; choose a cp_size of at most {heads}, or cp_method ring."
        )


@dataclass
class ContextParallel:
    """The cp group of this rank: how it slices a batch, and the all-to-alls around attention."""

    group: Any
    size: int
    rank: int
    method: str = "ulysses"
    mesh: Any = None
    positions: torch.Tensor | None = None  # this rank's position_ids of the batch under way (split sets them)
    _gathered: tuple[Any, Any] = field(default=(None, None), repr=False)  # (position_ids, their documents)

    def join(self, mesh: Any) -> None:
        """Takes the cp dimension of the strategy's mesh, built in its setup."""
        self.group, self.rank, self.mesh = mesh["cp"].get_group(), mesh["cp"].get_local_rank(), mesh["cp"]

    # -- the batch --------------------------------------------------------------------------------------------
    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of `tensor` along its sequence dimension `dim`: chunks rank and 2cp-1-rank."""
        chunks = tensor.chunk(cp_chunks(self.size), dim)
        return torch.cat([chunks[self.rank], chunks[-1 - self.rank]], dim)

    def split(self, inputs: Any, targets: Any, positions: bool) -> tuple[Any, Any]:
        """This rank's slice of a batch: every tensor of `inputs` (a dict, a tuple or one tensor) and `targets` with
        the batch's sequence length on dim 1. `positions`: give a dict of token ids its position_ids first, so that
        each slice knows where its tokens stand (a Hugging Face decoder's rotary embedding and document mask)."""
        length, chunks = _sequence_length(inputs), cp_chunks(self.size)
        if length % chunks:
            raise UsageError(
                f"Context parallelism cuts each sequence into 2 x cp_size = {chunks} equal chunks, and this "
                f"batch's sequences are {length} long; pad each batch to a multiple of engine.sequence_multiple "
                f"({chunks}), or choose a cp_size that divides it."
            )
        if isinstance(inputs, dict):
            inputs = dict(inputs)
            mask = inputs.pop("attention_mask", None)
            if mask is not None:
                _check_right_padding(mask)
            if positions and "position_ids" not in inputs:
                first = next(iter(inputs.values()))
                inputs["position_ids"] = torch.arange(length, device=first.device).expand(first.shape[0], -1)
        elif positions:
            raise UsageError(
                "Context parallelism hands the model each slice's position_ids as a keyword; pass the batch's inputs "
                "as a dict (e.g. {'input_ids': ids}) to forward_backward and forward_loss."
            )
        if self.method == "ring":  # torch's context_parallel slices the tensors itself (ring_context)
            return inputs, targets
        cut = functools.partial(_cut, self, length)
        self.positions = cut(inputs.get("position_ids")) if isinstance(inputs, dict) else None
        if isinstance(inputs, dict):
            inputs = {key: cut(value) for key, value in inputs.items()}
        elif isinstance(inputs, tuple):
            inputs = tuple(cut(value) for value in inputs)
        else:
            inputs = cut(inputs)
        return inputs, cut(targets)

    # -- attention ---------------------------------------------------------------------------------------------
    def to_heads(self, x: torch.Tensor, split: list[int]) -> torch.Tensor:
        """(batch, heads, this rank's positions, dim) -> (batch, this rank's heads, every position in order)."""
        mine = split[self.rank]
        b, _, s, d = x.shape
        out = _AllToAll.apply(x.transpose(0, 1), split, [mine] * self.size, self.group)
        gathered = out.view(self.size, mine, b, s, d).permute(2, 1, 0, 3, 4)  # (b, heads, rank, positions, dim)
        halves = gathered.reshape(b, mine, self.size, 2, s // 2, d)
        return torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(2)], 2).reshape(b, mine, s * self.size, d)

    def to_positions(self, y: torch.Tensor, split: list[int]) -> torch.Tensor:
        """The way back: (batch, this rank's heads, every position) -> (batch, this rank's positions, heads, dim)."""
        b, mine, length, d = y.shape
        chunks = y.view(b, mine, 2 * self.size, length // (2 * self.size), d)
        heads_tails = torch.stack([chunks[:, :, : self.size], chunks[:, :, self.size :].flip(2)], 3)
        s = length // self.size
        ordered = heads_tails.reshape(b, mine, self.size, s, d).permute(2, 1, 0, 3, 4)  # (rank, heads, b, s, d)
        out = _AllToAll.apply(ordered.reshape(self.size * mine, b, s, d), [mine] * self.size, split, self.group)
        return out.permute(1, 2, 0, 3)

    def documents(self, position_ids: torch.Tensor | None) -> list[list[tuple[int, int]]] | None:
        """Each row's documents over the whole sequence, in order, as (start, end) spans, from the slices'
        position_ids (a new document wherever the position does not follow on); None when every row is one
        document (plain causal attention)."""
        if position_ids is None:
            return None
        last, documents = self._gathered
        if last is position_ids:  # every layer of one forward gets the same tensor: gather it once
            return documents
        pieces = [torch.empty_like(position_ids) for _ in range(self.size)]
        dist.all_gather(pieces, position_ids.contiguous(), group=self.group)
        halves = [piece.chunk(2, 1) for piece in pieces]
        whole = torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], 1)
        starts = torch.ones_like(whole, dtype=torch.bool)
        starts[:, 1:] = whole[:, 1:] != whole[:, :-1] + 1
        documents = None
        if bool(starts[:, 1:].any()):
            length = whole.shape[1]
            firsts = [row.nonzero().flatten().tolist() for row in starts]
            documents = [list(zip(row, [*row[1:], length], strict=True)) for row in firsts]
        self._gathered = (position_ids, documents)
        return documents

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        position_ids: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention over the whole sequence of q, k, v given as this rank's positions (batch, heads,
        positions, dim), with packed documents kept apart; returns (batch, positions, heads, dim)."""
        heads, kv_heads = query.shape[1], key.shape[1]
        check_heads(heads, self.size)
        if heads % self.size or kv_heads % self.size:  # uneven: every rank needs the keys of its own query heads
            key = key.repeat_interleave(heads // kv_heads, 1)
            value = value.repeat_interleave(heads // kv_heads, 1)
            kv_heads = heads
        split, kv_split = head_split(heads, self.size), head_split(kv_heads, self.size)
        q, k, v = self.to_heads(query, split), self.to_heads(key, kv_split), self.to_heads(value, kv_split)
        documents = self.documents(position_ids)
        if documents is not None and len(documents) != q.shape[0]:
            raise UsageError(
                "Packed documents under context parallelism reach a model of one's own through the batch's "
                "position_ids, which a pipeline's micro-batches do not carry; drop pp_size, or pack one document "
                "per row."
            )
        attend = functools.partial(
            TORCH_SDPA, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
        if documents is None:
            out = attend(q, k, v)
        else:  # each document attends causally to itself alone: no sequence x sequence mask is ever made
            out = torch.cat(
                [
                    torch.cat(
                        [attend(q[r : r + 1, :, a:b], k[r : r + 1, :, a:b], v[r : r + 1, :, a:b]) for a, b in row], 2
                    )
                    for r, row in enumerate(documents)
                ]
            )
        return self.to_positions(out, split)

    def ring_context(self, inputs: Any, targets: Any) -> contextlib.AbstractContextManager[None]:
        """Inside it, torch's ring attention replaces sdpa and the batch's (batch, sequence) tensors are this rank's
        slices (torch's head-and-tail balancing, as ours); a null context for ulysses. Packed documents are refused:
        torch's ring attention runs causal sdpa without a mask."""
        if self.method != "ring":
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import context_parallel  # CUDA runs with ring only

        length = _sequence_length(inputs)
        values = (
            list(inputs.values())
            if isinstance(inputs, dict)
            else list(inputs)
            if isinstance(inputs, tuple)
            else [inputs]
        )
        buffers = [v for v in [*values, targets] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == length]
        positions = inputs.get("position_ids") if isinstance(inputs, dict) else None
        if positions is not None and self.documents_in(positions):
            raise UsageError(
                "cp_method ring runs torch's ring attention, causal over whole rows, and this batch packs several "
                "documents into a row; use cp_method ulysses (which keeps packed documents apart), or --no-packing."
            )
        return context_parallel(
            self.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        )

    @staticmethod
    def documents_in(positions: torch.Tensor) -> bool:
        """Whether any row of whole-sequence `positions` holds more than one document."""
        return bool((positions[:, 1:] != positions[:, :-1] + 1).any())


def sliced(cp: ContextParallel | None, inputs: Any, targets: Any) -> tuple[Any, Any, contextlib.AbstractContextManager]:
    """Under context parallelism, this rank's slice of a batch and where torch's ring attention runs (a null context
    under ulysses); without it, the batch as given."""
    if cp is None:
        return inputs, targets, contextlib.nullcontext()
    inputs, targets = cp.split(inputs, targets, positions=True)
    return inputs, targets, cp.ring_context(inputs, targets)


def _sequence_length(inputs: Any) -> int:
    first = (
        next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0] if isinstance(inputs, tuple) else inputs
    )
    if not torch.is_tensor(first) or first.dim() < 2:
        raise UsageError(
            "Context parallelism splits each batch's tensors along their sequence dimension (dim 1), and this batch's "
            "first input is not a (batch, sequence, ...) tensor; pass the token ids first."
        )
    return first.shape[1]


def _cut(cp: ContextParallel, length: int, value: Any) -> Any:
    """The rank's slice of a (batch, sequence, ...) tensor; anything else as it is."""
    if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == length:
        return cp.local(value)
    return value


def _check_right_padding(mask: torch.Tensor) -> None:
    """Right padding needs no mask under causal attention; anything else would be dropped, so it is refused."""
    kept = mask.bool()
    if bool((kept[:, 1:] & ~kept[:, :-1]).any()):
        raise UsageError(
            "Context parallelism drops the attention_mask, which is only right for padding at the end of each row, "
            "and this batch masks tokens before real ones; pad on the right (tokenizer.padding_side = 'right'), or "
            "pack documents with position_ids."
        )
