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
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from multigpu.config.layout import ParallelDims
from multigpu.core.errors import UsageError


@dataclass
class MoELayer:
    """One mixture layer: its block (the module whose output carries the load-balancing loss's gradient), router
    and experts."""

    name: str
    block: nn.Module
    router: nn.Module  # the module whose output holds the logits (under a LoRA wrapper, the one it wraps)
    experts: nn.Module  # the module holding the experts' weights
    num_experts: int
    top_k: int
    entry: nn.Module  # what the block calls with the tokens: the experts, or a LoRA wrapper around them


def is_experts(module: nn.Module) -> bool:
    count = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if not isinstance(count, int) or isinstance(count, bool) or not params:
        return False
    return all(p.dim() >= 2 and p.shape[0] == count for p in params) and any(p.dim() == 3 for p in params)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module a LoRA wrapper (peft's) wraps, all the way down; the module itself when it is none."""
    while hasattr(module, "get_base_layer") and module.get_base_layer() is not module:
        module = module.get_base_layer()
    return module


def _router_of(block: nn.Module, experts: nn.Module, count: int) -> list[nn.Module]:
    found = []
    for child in block.children():
        base = _unwrapped(child)
        weight = getattr(base, "weight", None)
        if base is not experts and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == count:
            found.append(base)
    return found


def find_layers(model: nn.Module, default_top_k: int | None = None) -> list[MoELayer]:
    """The model's mixture layers, in order: each experts module, its block (the nearest module above it with a
    router beside it) and router; refuses an experts module with no router, or several, beside it."""
    layers = []
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        count, path = module.num_experts, name.split(".")
        for depth in range(len(path) - 1, -1, -1):  # up through any wrappers to the block
            block = model.get_submodule(".".join(path[:depth]))
            routers = _router_of(block, module, count)
            if routers:
                break
        if len(routers) != 1:
            raise UsageError(
                f"{name} holds {count} experts, and {len(routers)} router(s) with a ({count}, hidden) weight sit "
                "beside it; give its block exactly one router module."
            )
        top_k = getattr(routers[0], "top_k", None) or getattr(block, "top_k", None) or default_top_k
        if not isinstance(top_k, int):
            raise UsageError(f"{name}'s router names no top_k (how many experts each token goes to); set router.top_k.")
        entry = block.get_submodule(path[depth])
        layers.append(MoELayer(name, block, routers[0], module, count, top_k, entry))
    return layers


def expert_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ranks laid out as (pp, edp, ep, tp): an ep group is ep consecutive data-parallel (x cp) ranks, as
    ParallelDims.expert_pool requires; edp, the ranks that hold the same experts and average their gradients."""
    data = dims.replicate * dims.shard * dims.cp
    ranks = torch.arange(dims.world_size).reshape(dims.pp, data // dims.ep, dims.ep, dims.tp)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))


# id -> mixture, for _aux_weight, which takes no Python object.
_MIXTURES: weakref.WeakValueDictionary[int, MixtureOfExperts] = weakref.WeakValueDictionary()


@torch.library.custom_op("multigpu::moe_aux_weight", mutates_args=())
def _aux_weight(grad: torch.Tensor, key: int) -> torch.Tensor:
    """The gradient of a layer's load-balancing loss: its weight as the mixture (`_MIXTURES[key]`) holds it when
    backward runs. An op of its own because a compiled block traces _InjectAux's backward with its forward: a
    weight read in Python there is the one `weigh` left before the forward (the last micro-step's; 1.0 in the first
    step), a constant of the graph that is compiled again whenever it changes, while the op's body runs at each
    backward."""
    mixture = _MIXTURES[key]
    weight = mixture.coefficient * mixture.backward_weight / len(mixture.layers)
    return torch.full((), weight, dtype=torch.float32, device=grad.device)


@_aux_weight.register_fake
def _(grad: torch.Tensor, key: int) -> torch.Tensor:
    return grad.new_empty((), dtype=torch.float32)


class _InjectAux(torch.autograd.Function):
    """Returns the block's output as it is; in backward, gives the layer's load-balancing loss the gradient the
    Engine set for this micro-step (its weight beside the main loss), so the loss needs no place in loss_fn and
    reaches every strategy's backward, a pipeline stage's too."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, mixture: MixtureOfExperts) -> torch.Tensor:
        ctx.key = id(mixture)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, _aux_weight(grad, ctx.key), None


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
    counted: bool = False  # under pp: whether weigh_pipeline knew the step's token count
    _pending: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _data_group: Any = field(default=None, repr=False)  # data_group's, resolved by attach

    def __post_init__(self) -> None:
        _MIXTURES[id(self)] = self

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters ep spreads: each layer's experts' own (LoRA adapters on them stay whole)."""
        return [p for layer in self.layers for p in layer.experts.parameters(recurse=False)]

    @property
    def ep(self) -> int:
        return self.dims.ep

    def attach(self, device_type: str) -> None:
        """Builds the groups (every rank must call it) and hooks each router and block."""
        if self.dims.world_size > 1:
            self.mesh = expert_mesh(self.dims, device_type)
            if self.dims.replicate * self.dims.shard * self.dims.cp > 1:
                # Resolved here, eagerly, and not at each call: the router's hook runs inside a compiled block,
                # where dynamo would trace the mesh's slicing and _flatten (a new process group, made on its first
                # call) on fake tensors and fail; a process group it is handed traces as a constant.
                self._data_group = self.mesh["edp", "ep"]._flatten("edp_ep").get_group()
        for index, layer in enumerate(self.layers):
            layer.router.register_forward_hook(self._routed(index))
            layer.block.register_forward_hook(self._carry_aux(index))

    def data_group(self) -> Any:
        """The ranks whose tokens one step's load-balancing loss counts: data-parallel x cp (not tp, whose ranks
        see the same tokens, nor pp, whose stages hold other layers); None where they are one rank."""
        return self._data_group

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
            group = self.data_group()
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

    def weigh(self, weight: float, count: int | torch.Tensor | None, data_world: int, device: torch.device) -> None:
        """Sets the weight the next backward gives the load-balancing loss, so that the step's gradient is the main
        loss's plus coefficient x this loss's: `weight` is the main loss's (engine/window.py), averaged over the
        `data_world` ranks' gradients, and a summed one is divided by the step's token count after backward (its
        global count for this micro-step here, summed on `device`: with accumulation, each micro-batch's
        load-balancing loss is weighted by its tokens)."""
        if self.coefficient == 0:  # nothing to weigh: spare the count's all-reduce on every micro-step
            return
        if count is None:
            self.backward_weight = weight * data_world
            return
        count = torch.as_tensor(count, dtype=torch.float64, device=device).detach().clone()
        group = self.data_group()
        if group is not None:
            dist.all_reduce(count, group=group)
        self.backward_weight = weight * float(count)

    def weigh_pipeline(
        self, weight: float, count: int | torch.Tensor | None, data_world: int, device: torch.device
    ) -> None:
        """`weigh` for a pipeline step, before it runs: its stages' backwards interleave with later forwards, so the
        step's token `count` comes from the targets, by the loss's own rule (engine.lm_loss's `count`; None where
        the loss has none). Each of the schedule's micro-batches (equal slices of the batch) gets its share;
        `pipeline_slices` divides by them."""
        self.counted = count is not None
        self.weigh(weight, count, data_world, device)

    def pipeline_slices(self, micro: int, summed: bool) -> None:
        """Divides the step's weight among the schedule's `micro` micro-batches; refuses a summed loss whose
        count weigh_pipeline could not know beforehand."""
        if summed and not self.counted and self.coefficient:
            raise UsageError(
                "Under pp a mixture-of-experts model's load-balancing loss is weighed before the pipeline runs, "
                "from the batch's tokens, which only engine.lm_loss(head) can count then; pass engine.lm_loss(head) "
                "as loss_fn, or a loss_fn that returns the mean."
            )
        self.backward_weight /= micro

    def _every_layer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(each layer's loss, each layer's tokens per expert) of the last forward, the layers of every pipeline
        stage included (a collective over the pp ranks: every rank calls it)."""
        if not self.aux:
            return None
        device = next(iter(self.aux.values())).device
        table = torch.zeros(len(self.layers), 1 + self.layers[0].num_experts, dtype=torch.float64, device=device)
        for index, value in self.aux.items():
            table[index, 0], table[index, 1:] = value, self.tokens[index]
        if self.dims.pp > 1:  # each stage ran its own layers
            dist.all_reduce(table, group=self.mesh["pp"].get_group())  # type: ignore[index]
        return table[:, 0].cpu(), table[:, 1:].cpu()

    def loss(self) -> float | None:
        """The last forward's load-balancing loss, the mean over layers; every rank gets the same number (and
        must ask for it under pp)."""
        found = self._every_layer()
        return None if found is None else float(found[0].mean())

    def metrics(self) -> dict[str, Any]:
        """The last forward's load-balancing loss and routed tokens over all data-parallel ranks, summed over
        layers: per expert, per rank of an ep group (the experts each holds: what each computes), and the busiest
        expert against the mean (1.0: balanced; a skewed router makes one rank the step's straggler). Every rank
        calls it."""
        found = self._every_layer()
        if found is None:
            return {}
        per_expert = found[1].sum(0)
        return {
            "moe_aux_loss": float(found[0].mean()),
            "moe_tokens_per_expert": [int(n) for n in per_expert.tolist()],
            "moe_tokens_per_rank": [int(n) for n in per_expert.view(self.ep, -1).sum(1).tolist()],
            "moe_busiest_expert_vs_mean": float(per_expert.max() / per_expert.mean().clamp(min=1e-9)),
        }


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
