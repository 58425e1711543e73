"""Mixture-of-experts layers over ranks: the router's load-balancing loss over the global batch, expert parallelism
(each rank of an ep group holds 1/ep of every layer's experts; tokens go to their experts' ranks and back by
all-to-all), and the tokens each expert and each rank received, for the metrics.

A mixture is found by its layout, which Hugging Face's Qwen3-MoE, Mixtral and OLMoE decoders share and a model of
one's own can follow: an experts module with an int `num_experts`, every parameter of it indexed by expert first (at
least one of them 3-D), called as `experts(hidden_states (tokens, hidden), top_k_index (tokens, k), top_k_weights
(tokens, k))`; beside it, a router whose `weight` is (num_experts, hidden) and whose output is its logits, or a tuple
that starts with them.

Dropless: every token reaches each of its k experts; the all-to-all sizes follow the router's choices each step, so
there is no capacity factor and nothing is dropped or padded (an expert that gets many tokens makes its rank slow,
which the per-rank token counts show).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from multigpu.core.errors import UsageError
from multigpu.core.layout import ParallelDims
from multigpu.strategies.context import _AllToAll


@dataclass
class MoELayer:
    """One mixture layer: its block (the module whose output carries the load-balancing loss's gradient), router
    and experts."""

    name: str
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int


def _is_experts(module: nn.Module) -> bool:
    count = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if not isinstance(count, int) or isinstance(count, bool) or not params:
        return False
    return all(p.dim() >= 2 and p.shape[0] == count for p in params) and any(p.dim() == 3 for p in params)


def find_layers(model: nn.Module, default_top_k: int | None = None) -> list[MoELayer]:
    """The model's mixture layers, in order; refuses an experts module without exactly one router beside it."""
    layers = []
    for name, module in model.named_modules():
        if not _is_experts(module):
            continue
        block_name = name.rpartition(".")[0]
        block = model.get_submodule(block_name)
        count = module.num_experts
        routers = [
            child
            for child in block.children()
            if child is not module
            and isinstance(getattr(child, "weight", None), torch.Tensor)
            and child.weight.dim() == 2
            and child.weight.shape[0] == count
        ]
        if len(routers) != 1:
            raise UsageError(
                f"{name} holds {count} experts, and its block {block_name or 'the model'} has {len(routers)} router(s) "
                f"with a ({count}, hidden) weight beside it; give the block exactly one router module."
            )
        top_k = getattr(routers[0], "top_k", None) or getattr(block, "top_k", None) or default_top_k
        if not isinstance(top_k, int):
            raise UsageError(
                f"{name}'s router names no top_k (how many experts each token goes to); set router.top_k."
            )
        layers.append(MoELayer(name, block, routers[0], module, count, top_k))
    return layers


def expert_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ranks laid out as (pp, edp, ep, tp): an ep group is ep consecutive data-parallel (x cp) ranks, as
    ParallelDims.expert_pool requires; edp, the ranks that hold the same experts and average their gradients."""
    data = dims.replicate * dims.shard * dims.cp
    ranks = torch.arange(dims.world_size).reshape(dims.pp, data // dims.ep, dims.ep, dims.tp)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))


class _InjectAux(torch.autograd.Function):
    """Returns the block's output as it is; in backward, gives the layer's load-balancing loss the gradient the
    Engine set for this micro-step (its weight beside the main loss), so the loss needs no place in loss_fn and
    reaches every strategy's backward, a pipeline stage's too."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, mixture: MixtureOfExperts) -> torch.Tensor:
        ctx.mixture = mixture
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        mixture = ctx.mixture
        weight = mixture.coefficient * mixture.backward_weight / len(mixture.layers)
        return grad, torch.full((), weight, dtype=torch.float32, device=grad.device), None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


@dataclass
class MixtureOfExperts:
    """A run's mixture layers and what happens around them: each router's load-balancing loss over the tokens of
    every data-parallel (and cp) rank, and with ep > 1 the experts spread over the ep group."""

    layers: list[MoELayer]
    dims: ParallelDims
    coefficient: float  # the load-balancing loss's weight beside the main loss (the model's router_aux_loss_coef)
    mesh: DeviceMesh | None = None  # expert_mesh; None in one process
    backward_weight: float = 1.0  # the Engine's weight of this micro-step's loss (set before each backward)
    aux: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its global loss in the last forward
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> global tokens per expert, last forward
    _pending: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def ep(self) -> int:
        return self.dims.ep

    def attach(self, device_type: str) -> None:
        """Builds the groups (every rank must call it) and hooks each router and block."""
        if self.dims.world_size > 1:
            self.mesh = expert_mesh(self.dims, device_type)
        for index, layer in enumerate(self.layers):
            layer.router.register_forward_hook(self._routed(index))
            layer.block.register_forward_hook(self._carry_aux(index))

    def _data_group(self) -> Any:
        """The ranks whose tokens one step's load-balancing loss counts: data-parallel x cp (not tp, whose ranks
        see the same tokens, nor pp, whose stages hold other layers)."""
        if self.mesh is None or self.dims.replicate * self.dims.shard * self.dims.cp == 1:
            return None
        return self.mesh["edp", "ep"]._flatten("edp_ep").get_group()  # flattened once, the same mesh after

    def _routed(self, index: int) -> Callable[..., None]:
        layer = self.layers[index]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            probs = torch.softmax(logits.reshape(-1, layer.num_experts).float(), dim=-1)
            chosen = probs.topk(layer.top_k, dim=-1).indices.reshape(-1)
            counts = torch.zeros(layer.num_experts, dtype=torch.float32, device=probs.device)
            counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            shares = probs.sum(0)
            rows = torch.tensor([probs.shape[0]], dtype=torch.float32, device=probs.device)
            totals = torch.cat([counts, shares.detach(), rows])
            group = self._data_group()
            if group is not None:
                dist.all_reduce(totals, group=group)
            every = layer.num_experts
            counts, all_shares, rows = totals[:every], totals[every : 2 * every], totals[-1]
            fraction = counts / rows
            # Switch Transformer's loss over the global batch: E x sum_e (share of tokens routed to e) x (mean router
            # probability of e). The token fractions are global constants; this rank's probabilities are its part
            # of the mean, so the ranks' parts add up to the global loss and its gradient.
            self._pending[index] = every * (fraction * shares).sum() / rows
            self.aux[index] = (every * (fraction * all_shares).sum() / rows).detach()
            self.tokens[index] = counts.detach()

        return hook

    def _carry_aux(self, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            part = self._pending.pop(index, None)
            if part is None or not part.requires_grad or self.coefficient == 0:
                return output
            if isinstance(output, tuple):
                return (_InjectAux.apply(output[0], part, self), *output[1:])
            return _InjectAux.apply(output, part, self)

        return hook

    def weigh(self, weight: float, count: int | torch.Tensor | None, window: Any) -> None:
        """Sets the weight the next backward gives the load-balancing loss, so that the step's gradient is the main
        loss's plus coefficient x this loss's: the main loss is averaged over the data_world ranks' gradients, and
        a summed one is divided by the step's token count after backward (its global count for this micro-step
        here: with accumulation, each micro-batch's load-balancing loss is weighted by its tokens)."""
        if count is None:
            self.backward_weight = weight * window.data_world
            return
        count = torch.as_tensor(count, dtype=torch.float64, device=window.device).detach().clone()
        group = self._data_group()
        if group is not None:
            dist.all_reduce(count, group=group)
        self.backward_weight = weight * float(count)

    def loss(self) -> float | None:
        """The last forward's load-balancing loss, the mean over layers (every rank gets the same number)."""
        if not self.aux:
            return None
        return float(torch.stack(list(self.aux.values())).mean())

    def metrics(self) -> dict[str, Any]:
        """The last forward's load-balancing loss and routed tokens over all data-parallel ranks, summed over
        layers: per expert, per rank of an ep group (the experts each holds: what each computes), and the busiest
        expert against the mean (1.0: balanced; a skewed router makes one rank the step's straggler)."""
        if not self.tokens:
            return {}
        per_expert = torch.stack([t.cpu() for t in self.tokens.values()]).sum(0)
        return {
            "moe_aux_loss": self.loss(),
            "moe_tokens_per_expert": [int(n) for n in per_expert.tolist()],
            "moe_tokens_per_rank": [int(n) for n in per_expert.view(self.ep, -1).sum(1).tolist()],
            "moe_busiest_expert_vs_mean": float(per_expert.max() / per_expert.mean().clamp(min=1e-9)),
        }

    # Expert parallelism.

    def parallelize(self, device: torch.device) -> None:
        """Gives each rank of an ep group its 1/ep of every layer's experts (rank 0's values, the same on every
        rank first), as DTensors sharded by expert over the ep dimension: checkpoints then hold whole layers and
        load into another ep or another strategy. The experts' forward becomes the all-to-all dispatch."""
        if self.ep == 1:
            return
        assert self.mesh is not None
        ep_mesh = self.mesh["ep"]
        for layer in self.layers:
            for name, param in list(layer.experts.named_parameters(recurse=False)):
                whole = param.data.to(device)
                dist.broadcast(whole, src=0)
                local = whole.chunk(self.ep, dim=0)[ep_mesh.get_local_rank()].clone()
                sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
                layer.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            forward = layer.experts.forward
            layer.experts.forward = self._dispatching(layer, forward)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.experts.parameters(recurse=False)]

    def _dispatching(self, layer: MoELayer, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        group = self.mesh["ep"].get_group()  # type: ignore[index]
        experts, ep, local = layer.experts, self.ep, layer.num_experts // self.ep

        def dispatched(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)  # grouped by expert, so by the rank that holds it
            token = order // top_k_index.shape[-1]
            per_expert = torch.bincount(flat, minlength=layer.num_experts)
            arriving = torch.empty_like(per_expert)
            dist.all_to_all_single(arriving, per_expert, group=group)  # [source rank, my expert]
            send = per_expert.view(ep, local).sum(1).tolist()
            receive = arriving.view(ep, local).sum(1).tolist()
            inputs = _AllToAll.apply(hidden[token], send, receive, group)
            weights = _AllToAll.apply(top_k_weights.reshape(-1)[order].unsqueeze(1), send, receive, group)
            which = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(arriving)
            outputs = self._local_experts(experts, forward, inputs, which.unsqueeze(1), weights.to(inputs.dtype))
            back = _AllToAll.apply(outputs, receive, send, group)
            return hidden.new_zeros(hidden.shape).index_add(0, token, back.to(hidden.dtype))

        return dispatched

    def _local_experts(
        self,
        experts: nn.Module,
        forward: Callable[..., torch.Tensor],
        inputs: torch.Tensor,
        which: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The module's own forward over this rank's experts: its parameters seen as their local slices (whose
        gradient is divided by ep: every rank of the ep group added its tokens' part, and the data-parallel mean
        over the edp ranks would otherwise count each ep group's tokens ep times)."""
        held = dict(experts._parameters)
        count = experts.num_experts
        try:
            for name, param in held.items():
                value = param.to_local() if isinstance(param, DTensor) else param
                experts._parameters[name] = _ScaleGrad.apply(value, 1.0 / self.ep)  # type: ignore[assignment]
            experts.num_experts = count // self.ep
            return forward(inputs, which, weights)
        finally:
            experts._parameters.update(held)
            experts.num_experts = count


def mixture_of_experts(model: nn.Module, dims: ParallelDims, device_type: str) -> MixtureOfExperts | None:
    """The model's mixture (attached: every rank must call this), or None for a model without one; refuses ep
    where the experts do not divide by it."""
    config = getattr(model, "config", None)
    layers = find_layers(model, getattr(config, "num_experts_per_tok", None))
    if not layers:
        if dims.ep > 1:
            raise UsageError(
                f"ep_size {dims.ep} spreads a mixture-of-experts model's experts, and this model has no experts module "
                "(see docs/strategies.md, Mixture of experts); drop ep_size."
            )
        return None
    uneven = sorted({layer.num_experts for layer in layers if layer.num_experts % dims.ep})
    if uneven:
        raise UsageError(
            f"ep_size {dims.ep} does not divide the model's {uneven[0]} experts per layer; choose an ep_size that "
            f"divides {uneven[0]} (and the data-parallel processes)."
        )
    coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    mixture = MixtureOfExperts(layers, dims, coefficient)
    mixture.attach(device_type)
    return mixture



def without_experts(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A tensor-parallel plan less its entries for a mixture's experts (and their parameters) and routers: tp
    splits the dense layers, and each tp rank runs the experts whole on the tokens it shares with the others (ep
    spreads them instead). Less, too, the entries for a dense MLP that no layer has: a mixture's plan names both
    kinds of layer, and a model may make every layer a mixture."""
    layers = find_layers(model, default_top_k=0)
    if not layers:
        return plan
    routers = {id(layer.router) for layer in layers}
    names = {name for name, module in model.named_modules() if id(module) in routers}
    for layer in layers:
        names |= {layer.name, *(f"{layer.name}.{name}" for name, _ in layer.experts.named_parameters())}

    modules = [name for name, _ in model.named_modules()]

    def matches(pattern: str, among: Iterable[str]) -> bool:  # `*` is one name in the path, as tp reads it
        regex = re.compile(r"(.*\.)?" + r"[^.]+".join(map(re.escape, pattern.split("*"))))
        return any(regex.fullmatch(name) for name in among)

    return {p: style for p, style in plan.items() if not matches(p, names) and matches(p, modules)}
