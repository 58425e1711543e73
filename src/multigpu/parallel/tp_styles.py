"""The styles a tensor-parallel plan may name (Hugging Face's names), and what each does under plain tensor
parallelism, under sequence parallelism of a Hugging Face decoder, and under a plan of one's own that names its
sequence-parallel modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel


class _SumGradOverTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedSummingGrads(ParallelStyle):
    """A module whose weights stay whole on every tp rank but which each rank applies to its own slice (Qwen3's
    per-head q and k norms after the column-split projections): its gradient on each rank is its slice's part, so
    the parts are summed over the tp group in backward, before any data-parallel reduction."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, held = device_mesh.get_group(), {}

        def summing(mod: nn.Module, args: Any) -> None:
            held.update(mod._parameters)
            for name, param in held.items():
                if param is not None and param.requires_grad:
                    mod._parameters[name] = _SumGradOverTp.apply(param, group)  # type: ignore[assignment]

        def restore(mod: nn.Module, args: Any, output: Any) -> None:
            mod._parameters.update(held)
            held.clear()

        module.register_forward_pre_hook(summing)
        module.register_forward_hook(restore)
        return module


class EmbeddingRowwise(RowwiseParallel):
    """An embedding split by vocabulary rows whose summed output is whole (or scattered by position) before it leaves
    the module. torch starts that collective asynchronously and hands on an AsyncCollectiveTensor; a compiled block
    that takes one and adds it to its own output (a residual) gives back its gradient as a plain tensor, which
    DTensor's redistribution backward cannot take (torch 2.13: "'Tensor' object has no attribute '_local_tensor'").
    Inside the blocks dynamo traces the collectives itself, so the other styles keep torch's."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


#: The styles a plan may name (Hugging Face's names), and what each splits. A column split leaves each process a
#: slice of the layer's outputs (the next rowwise layer takes exactly that slice); a row split sums the partial
#: outputs of every process, so its output is whole again.
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # The output head: split by vocabulary, the logits gathered whole so that any loss function works on them.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # An embedding split by vocabulary rows: each process looks up the tokens in its rows, the sum is whole.
    "embedding_rowwise": lambda: EmbeddingRowwise(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": ReplicatedSummingGrads,
}


#: Under sequence parallelism the residual stream between the split layers is split by sequence position (dim 1):
#: a row split's partial outputs are summed and scattered by position (reduce-scatter) instead of summed whole, and
#: the head gathers the positions before its column split. The norms run on their positions only; their weights
#: stay whole and their gradients are summed over the tp group.
SEQUENCE_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "colwise_gather_output": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    "embedding_rowwise": STYLES["embedding_rowwise"],
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    "replicated_with_grad_allreduce": ReplicatedSummingGrads,
}
#: A plan of one's own model that names `sequence_parallel` modules (its norms) runs Megatron's convention: the
#: embedding scatters its output by position, each column split gathers its input's positions first, each row split
#: scatters its output by position, so everything between them (the named modules, residual additions) sees its
#: rank's positions only.
PLAN_SEQUENCE_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": lambda: ColwiseParallel(input_layouts=Shard(1)),
    "rowwise": SEQUENCE_STYLES["rowwise"],
    "colwise_gather_output": SEQUENCE_STYLES["colwise_gather_output"],
    "embedding_rowwise": lambda: EmbeddingRowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
    "sequence_parallel": SEQUENCE_STYLES["sequence_parallel"],
    "replicated_with_grad_allreduce": ReplicatedSummingGrads,
}
