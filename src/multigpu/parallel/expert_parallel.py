"""Expert parallelism: each rank of an ep group holds 1/ep of every mixture layer's experts, and the tokens the
router sends to an expert travel to its rank and back by all-to-all (`all_to_all_single`: NCCL on GPUs, gloo here).

The experts' weights become DTensors sharded by expert over the ep dimension of `expert_mesh`, so checkpoints hold
whole layers (DCP reshards them for another ep, or none) and the gradient norm counts each once; zero2, zero3 and
hsdp shard them further over the ranks that hold the same experts (edp). LoRA adapters on the experts (peft's
`target_parameters`) stay whole on every rank, like any other adapter: a rank applies the slices of its experts.

Dropless: each step's all-to-all sizes follow the router's choices, so every token reaches each of its k experts,
nothing is padded to a capacity and nothing is dropped. The cost is that a rank whose experts are popular computes
more: the per-rank token counts in the metrics show it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from multigpu.parallel.context import _AllToAll
from multigpu.parallel.experts import MixtureOfExperts, MoELayer


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def held_layers(mixture: MixtureOfExperts) -> list[MoELayer]:
    """The layers whose experts this rank holds: all of them, but under pp its stages' only (the others' are on the
    meta device)."""
    return [layer for layer in mixture.layers if not any(p.is_meta for p in layer.experts.parameters())]


def parallelize(mixture: MixtureOfExperts, device: torch.device, alike: bool = False) -> list[MoELayer]:
    """Gives each rank of an ep group its 1/ep of every layer's experts that it holds as DTensors sharded by expert,
    and makes what the block calls with the tokens dispatch them; returns those layers. The values are rank 0's,
    broadcast first unless the ranks start `alike` already (the strategy broadcast the whole model). The strategy's
    data-parallel wrapping then takes the spread experts, which hold_experts readies for it."""
    assert mixture.mesh is not None
    ep_mesh = mixture.mesh["ep"]
    held = held_layers(mixture)
    for layer in held:
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            whole = param.data.to(device)
            if not alike:
                dist.broadcast(whole, src=0)
            local = whole.chunk(mixture.ep, dim=0)[ep_mesh.get_local_rank()].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            layer.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.entry.forward = _dispatching(mixture, layer, layer.entry.forward)
    return held


def _dispatching(
    mixture: MixtureOfExperts, layer: MoELayer, forward: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    mesh = mixture.mesh["ep"]  # type: ignore[index]
    group, ep, rank = mesh.get_group(), mixture.ep, mesh.get_local_rank()
    local = layer.num_experts // ep

    def dispatched(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert, so by the rank that holds it
        token = order // top_k_index.shape[-1]
        per_expert = torch.bincount(flat, minlength=layer.num_experts)
        arriving = torch.empty_like(per_expert)
        dist.all_to_all_single(arriving, per_expert, group=group)  # [source rank, my expert]
        send = per_expert.view(ep, local).sum(1).tolist()
        receive = arriving.view(ep, local).sum(1).tolist()
        inputs = _AllToAll.apply(hidden[token], send, receive, group, 1)
        weights = _AllToAll.apply(top_k_weights.reshape(-1)[order].unsqueeze(1), send, receive, group, 1)
        which = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(arriving).unsqueeze(1)
        with _local_view(layer, rank, ep):
            outputs = forward(inputs, which, weights.to(inputs.dtype))
        back = _AllToAll.apply(outputs, receive, send, group, 1)
        return hidden.new_zeros(hidden.shape).index_add(0, token, back.to(hidden.dtype))

    return dispatched


@contextlib.contextmanager
def _local_view(layer: MoELayer, rank: int, ep: int) -> Iterator[None]:
    """Inside it, the modules under the layer's entry see this rank's experts only, numbered from 0: the experts'
    weights as their local slices, and LoRA adapters on them (peft's ParamWrapper: A's rows expert by expert, B's
    columns interleaved by expert) sliced to the same experts. The experts' slices' gradients are divided by ep:
    every rank of the ep group added its tokens' part, and the mean over the edp ranks would count each ep group's
    tokens ep times; the adapters are whole on every rank and averaged over all of them, as any other parameter."""
    count, local = layer.num_experts, layer.num_experts // ep
    swapped: list[tuple[nn.Module, str, Any]] = []
    numbered: list[nn.Module] = []

    def swap(module: nn.Module, name: str, value: torch.Tensor) -> None:
        swapped.append((module, name, module._parameters[name]))
        module._parameters[name] = value  # type: ignore[assignment]

    for name, param in layer.experts._parameters.items():
        value = param.to_local() if isinstance(param, DTensor) else param
        swap(layer.experts, name, _ScaleGrad.apply(value, 1.0 / ep) if value.requires_grad else value)
    for module in layer.entry.modules():
        if getattr(module, "num_experts", None) != count:
            continue
        numbered.append(module)
        for adapter, down in getattr(module, "lora_A", {}).items():
            rows = down.weight.shape[0] // count
            swap(down, "weight", down.weight[rank * local * rows : (rank + 1) * local * rows])
            up = module.lora_B[adapter]
            width = up.weight.shape[0]
            swap(
                up,
                "weight",
                up.weight.view(width, -1, count)[:, :, rank * local : (rank + 1) * local].reshape(width, -1),
            )
    try:
        for module in numbered:
            module.num_experts = local
        yield
    finally:
        for module, name, value in reversed(swapped):
            module._buffers.pop(name, None)  # where peft's parametrization, removed, left the local slice
            module._parameters[name] = value
        for module in numbered:
            module.num_experts = count


def _average_gradients(params: list[nn.Parameter], group: Any) -> None:
    """Each of `params`' gradients averaged over `group` as its backward ends (every micro-step: the mean of a
    sum is the sum of the means)."""

    def average(param: torch.Tensor) -> None:
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=group)

    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


def _shard_entries(
    mixture: MixtureOfExperts, layers: list[MoELayer], policy: MixedPrecisionPolicy, reshard_after_forward: bool
) -> None:
    held = {id(p) for p in mixture.expert_parameters()}
    for layer in layers:
        device = next(layer.experts.parameters()).device
        adapters = [p for p in layer.entry.parameters() if id(p) not in held]
        fully_shard(
            layer.entry,
            mesh=mixture.mesh["edp"],  # type: ignore[index]
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=set(adapters) or None,
        )
        for adapter in adapters:
            adapter.data = adapter.data.to(device)
        _average_gradients(adapters, mixture.data_group())


def hold_experts(mixture: MixtureOfExperts, sharding: tuple[MixedPrecisionPolicy, bool] | None) -> None:
    """Expert parallelism's last step (engine/parallelize.py, after a pipeline's stages are cut and before the
    strategy's wrapping): the ranks that hold the same experts (edp) keep the layers this rank holds alike. With
    `sharding` (zero2, zero3, hsdp, and zero inside pipeline stages: the policy and reshard_after_forward of their
    units), each layer's experts (what its block calls: a LoRA wrapper included) are an FSDP unit of their own over
    the edp ranks; LoRA adapters on them are whole on every rank and averaged over all data-parallel ranks, so that
    unit leaves them out and a hook averages them (the unit's reduction would average them over the edp ranks only).
    Without (ddp, pp's whole replicas), the experts' gradients are averaged over the edp ranks by hook, and the
    wrapping leaves them out of its own averaging (spread_parameters)."""
    layers = held_layers(mixture)
    if sharding is not None:
        _shard_entries(mixture, layers, *sharding)
        return
    params = [p for layer in layers for p in layer.experts.parameters(recurse=False)]
    _average_gradients(params, mixture.mesh["edp"].get_group())  # type: ignore[index]


def is_spread(param: torch.Tensor) -> bool:
    """Whether `param` is a slice ep spread (`parallelize`): a DTensor laid out over the ep ranks."""
    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def leave_out_of_ddp(model: nn.Module) -> None:
    """Expert parallelism beside DDP: each rank's experts (DTensors over the ep ranks, which DDP cannot take) left out
    of DDP; hold_experts averages their gradients over the ranks that hold the same experts."""
    ignored = [name for name, p in model.named_parameters() if is_spread(p)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
