"""Pipeline parallelism: consecutive parts of the model on consecutive processes, micro-batches flowing through.

`pp` splits the model into pp_size x stages_per_rank stages (torch.distributed.pipelining): an `nn.Sequential` by
its children, a Hugging Face decoder language model (embeddings, decoder layers, final norm and head; Llama and its
kin) by its layers, the embeddings with the first stage and the norm and head with the last. Each process keeps
only its stages' modules; the others are moved to the meta device. A training micro-step is one schedule step
(gpipe, 1f1b or interleaved) over `microbatches` slices of the batch, so forward and backward are one call:
`engine.forward_backward`. Evaluation runs the schedule forward only: `engine.forward_loss`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.core.precision import Precision
from multigpu.planner.layout import check_schedule
from multigpu.strategies.base import StepOutcome, Strategy, frozen_names
from multigpu.strategies.mesh import ParallelDims
from multigpu.strategies.tp import start_alike

#: What a stage's loss function hands back to the engine: the loss (a mean, or a sum with its count).
LossFn = Callable[[Any, Any], Any]


class PipelineModel(nn.Module):
    """This rank's modules under their names in the whole model (so checkpoints key them as it does); the whole
    model, its other modules on the meta device, stays reachable as `module` (for its config and save methods)."""

    def __init__(self, whole: nn.Module, kept: dict[str, nn.Module]) -> None:
        super().__init__()
        for path, module in kept.items():
            parent = self
            *outer, last = path.split(".")
            for name in outer:
                if name not in parent._modules:
                    parent.add_module(name, nn.Module())
                parent = parent._modules[name]
            parent.add_module(last, module)
        self._whole = [whole]  # a list: not a child, so its modules are not this model's

    @property
    def module(self) -> nn.Module:
        return self._whole[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(
            "Under strategy pp each process holds only its stages, so the model cannot be called whole; train with "
            "engine.forward_backward(model, inputs, targets, loss_fn) and evaluate with engine.forward_loss."
        )


class _SequentialStage(nn.Module):
    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = parts  # a plain list: the modules belong to the PipelineModel, not to this view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class _DecoderStage(nn.Module):
    """A run of a Hugging Face decoder's layers; the first stage embeds the tokens, the last applies the final
    norm and the head. Every stage gets the batch's keywords (the attention mask) from the schedule; the hidden
    states come from the previous stage."""

    def __init__(self, decoder: nn.Module, head: nn.Module, layers: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.parts = {"decoder": decoder, "head": head, "layers": layers}  # views, as above
        self.first, self.last = first, last

    def forward(
        self,
        hidden: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> Any:
        from transformers.masking_utils import create_causal_mask

        decoder = self.parts["decoder"]
        hidden = input_ids if hidden is None else hidden  # the first stage: the tokens, as a keyword
        if attention_mask is None:
            attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        if self.first:
            hidden = decoder.embed_tokens(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = decoder.rotary_emb(hidden, positions)
        mask = create_causal_mask(
            config=decoder.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        for layer in self.parts["layers"]:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        if self.last:
            return self.parts["head"](decoder.norm(hidden))
        return hidden


def split_evenly(count: int, parts: int) -> list[range]:
    base, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def stage_parts(model: nn.Module, stages: int) -> list[tuple[dict[str, nn.Module], Callable[[bool, bool], nn.Module]]]:
    """For each stage: {name in the model: module} and a function (first, last) -> the stage's forward module."""
    inner, prefix = model, ""
    if hasattr(model, "base_model") and hasattr(model.base_model, "model"):  # peft's PeftModel around the LM
        inner, prefix = model.base_model.model, "base_model.model."
    decoder = getattr(inner, "model", None)
    if all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(
        inner, "lm_head"
    ):
        return _decoder_parts(inner, prefix, stages)
    if isinstance(model, nn.Sequential):
        children = list(model.named_children())
        if len(children) < stages:
            raise UsageError(f"{len(children)} layers cannot fill {stages} pipeline stages; use fewer stages.")
        parts = []
        for run in split_evenly(len(children), stages):
            chunk = children[run.start : run.stop]
            modules = [module for _, module in chunk]
            parts.append((dict(chunk), lambda first, last, modules=modules: _SequentialStage(modules)))
        return parts
    raise UsageError(
        f"Strategy pp splits an nn.Sequential or a Hugging Face decoder language model, not {type(model).__name__}; "
        "write the model as an nn.Sequential of its stages' layers, or use another strategy."
    )


def _decoder_parts(inner: nn.Module, prefix: str, stages: int) -> list:
    decoder, layers = inner.model, list(inner.model.layers)
    if len(layers) < stages:
        raise UsageError(f"The model's {len(layers)} layers cannot fill {stages} pipeline stages; use fewer stages.")
    parts = []
    for index, run in enumerate(split_evenly(len(layers), stages)):
        first, last = index == 0, index == stages - 1
        kept = {f"{prefix}model.layers.{i}": layers[i] for i in run}
        kept[f"{prefix}model.rotary_emb"] = decoder.rotary_emb
        if first:
            kept[f"{prefix}model.embed_tokens"] = decoder.embed_tokens
        if last:
            kept[f"{prefix}model.norm"] = decoder.norm
            kept[f"{prefix}lm_head"] = inner.lm_head
        chunk = [layers[i] for i in run]
        parts.append((kept, lambda f, la, chunk=chunk: _DecoderStage(decoder, inner.lm_head, chunk, f, la)))
    return parts


@dataclass
class PipelineParallel(Strategy):
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    #: Slices of each batch that flow through the pipeline one after another; None: one per stage.
    microbatches: int | None = None
    _schedules: dict = field(default_factory=dict, repr=False)

    name = "pp"
    mesh_dims = ("pp",)
    pipelined = True

    def __post_init__(self) -> None:
        check_schedule(self.schedule, self.stages_per_rank, ("pp_schedule", "pp_stages_per_rank"))

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(pp=world_size)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if optimizer is not None and optimizer.state:
            raise UsageError("pp must split a fresh optimizer; call engine.setup before the first step.")
        mesh = self.build_mesh(env)
        self._group, self._device = mesh["pp"].get_group(), env.device
        pp, rank = env.world_size, env.rank
        self._stages = pp * self.stages_per_rank
        self._mine = list(range(rank, self._stages, pp))  # interleaved: stages r, r + pp, ...
        parts = stage_parts(model, self._stages)
        kept = {name: module for stage in self._mine for name, module in parts[stage][0].items()}
        start_alike(model)
        held = {id(p) for module in kept.values() for p in module.parameters()}
        self._ties = self._tied_groups(model, parts, pp)
        # What other stages hold goes to the meta device: its memory is given back, its shapes stay.
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) not in held:
                    module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        for module in kept.values():
            module.to(env.device)  # in place: the optimizer's Parameters stay the ones it holds
        self._forwards = [parts[stage][1](stage == 0, stage == self._stages - 1) for stage in self._mine]
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in held]
        return PipelineModel(model, kept), optimizer

    def _tied_groups(self, model: nn.Module, parts: list, pp: int) -> list[tuple[nn.Parameter, Any]]:
        """Parameters that two stages share (a head tied to the embeddings), each with the process group of the
        ranks that hold it: their gradients are summed there after backward, so both copies step alike."""
        holders: dict[int, set[int]] = {}
        by_id = {id(p): p for p in model.parameters()}
        for stage, (kept, _) in enumerate(parts):
            for module in kept.values():
                for p in module.parameters():
                    holders.setdefault(id(p), set()).add(stage % pp)
        ties = []
        for pid, ranks in holders.items():
            if len(ranks) > 1:
                group = dist.new_group(sorted(ranks))  # every rank makes every group, in the same order
                ties.append((by_id[pid], group, len(ranks)))
        me = dist.get_rank()
        self._tie_count = {id(p): n for p, _, n in ties}
        return [(p, group) for p, group, _ in ties if me in holders[id(p)]]

    def holders(self, param: torch.Tensor) -> int:
        return self._tie_count.get(id(param), 1)  # each stage's weights live on one rank, tied ones on two

    # -- one micro-step --------------------------------------------------------------------------------------------
    def pipeline_step(
        self, inputs: Any, targets: torch.Tensor, loss_fn: LossFn, weigh: Callable[[Any, float], Any], train: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the schedule over `inputs` (forward and backward when `train`, forward only otherwise); returns the
        loss (summed over micro-batches when loss_fn gives (sum, count), else the batch's mean) and the count, both
        on every rank. `weigh(loss_fn's result, the micro-batch's share of the batch's rows)` gives the scalar each
        micro-batch's backward starts from."""
        args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
        args = args if isinstance(args, tuple) else (args,)
        shapes = tuple(tuple(t.shape) for t in [*args, *kwargs.values(), targets] if torch.is_tensor(t))
        rows = len(targets)
        # A stage sizes its buffers for one micro-batch shape, so the slices must be equal: a batch whose rows the
        # wanted count does not divide (a short last batch) takes the largest count that does.
        wanted = min(self.microbatches or self._stages, rows)
        micro = max(d for d in range(1, wanted + 1) if rows % d == 0)
        results: list = []

        def stage_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            result = loss_fn(output, target)
            results.append((result, len(target) / rows))
            return weigh(result, len(target) / rows)

        schedule = self._schedule(shapes, micro)
        schedule._loss_fn = stage_loss  # the schedule keeps one loss function; this step's is the caller's
        run = schedule.step if train else schedule.eval
        run(*args, target=targets, losses=[], **kwargs)
        # Shape inference may call the loss on stand-ins first; the step's own calls are the last `micro`.
        results = results[len(results) - micro :] if self._mine[-1] == self._stages - 1 else []
        summed = bool(results) and isinstance(results[0][0], tuple)
        totals = torch.zeros(3, dtype=torch.float64, device=self._device)  # loss, count, whether summed
        for result, share in results:
            if summed:
                totals[0] += result[0].detach().double()
                totals[1] += torch.as_tensor(result[1], dtype=torch.float64, device=self._device)
            else:
                totals[0] += result.detach().double() * share
        totals[2] = float(summed)
        dist.all_reduce(totals, group=self._group)  # only the last stage computed them
        loss, count, summed = totals[0], totals[1], bool(totals[2] > 0)
        return (loss, count) if summed else (loss, None)

    def _schedule(self, shapes: tuple, micro: int) -> Any:
        """The schedule for batches of these shapes: a stage sizes its buffers at its first step, so each new
        shape (a shorter last batch) gets stages of its own."""
        if (shapes, micro) not in self._schedules:
            stages = [
                PipelineStage(forward, stage, self._stages, self._device, group=self._group)
                for forward, stage in zip(self._forwards, self._mine, strict=True)
            ]
            kind = self._schedule_kind(micro)
            schedule = kind(stages if len(stages) > 1 else stages[0], micro, loss_fn=lambda o, t: o, scale_grads=False)
            self._schedules[(shapes, micro)] = schedule
        return self._schedules[(shapes, micro)]

    def _schedule_kind(self, micro: int) -> type:
        """The configured schedule, or for a batch too short for it (fewer micro-batches than 1f1b has stages, or
        than interleaving fills in whole rounds) the all-forwards-then-all-backwards order: the same gradients, and
        no more activations in flight than the configured schedule would hold with enough micro-batches."""
        pp = self._stages // self.stages_per_rank
        if self.schedule == "interleaved":
            rounds = max(1, micro // pp)
            return ScheduleInterleaved1F1B if micro >= pp and micro % rounds == 0 else ScheduleLoopedBFS
        if self.schedule == "1f1b" and micro >= self._stages:
            return Schedule1F1B
        return ScheduleGPipe

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, *args: Any) -> StepOutcome:
        for param, group in self._ties:  # the embedding's and the head's shares of a tied weight's gradient
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
        return super().optimizer_step(model, optimizer, *args)

    def grad_scaler(self, device: torch.device) -> None:
        raise UsageError(
            "fp16-mixed's loss scaling needs every pipeline stage to see the loss, which only the last one computes; "
            "use bf16-mixed or 32 under strategy pp."
        )

    # A tied weight is named differently on the ranks that hold it (the embedding's name on the first, the head's
    # on the last); the optimizer's state is keyed by the whole model's first name, as one process keys it.
    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _renamed(super().optimizer_state_dict(model, optimizer), self._canonical(model))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        back = {canonical: local for local, canonical in self._canonical(model).items()}
        super().load_optimizer_state_dict(model, optimizer, _renamed(state, back))

    def _canonical(self, model: nn.Module) -> dict[str, str]:
        first = {id(p): name for name, p in model.module.named_parameters()}
        return {name: first[id(p)] for name, p in model.named_parameters() if first.get(id(p), name) != name}

    def full_state_dict(self, model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
        """Every stage's weights, gathered onto rank 0's CPU (nothing on the other ranks)."""
        # A tied weight's second name (the head's, on the last stage) is left out, as the whole model's state has it.
        left_out = (frozen_names(model) if trainable_only else set()) | set(self._canonical(model))
        mine = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in left_out}
        gathered: list = [None] * dist.get_world_size(self._group) if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._group)
        return {k: v for part in gathered for k, v in part.items()} if gathered else {}


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    if not names:
        return state
    out = dict(state)
    out["state"] = {names.get(k, k): v for k, v in state["state"].items()}
    out["param_groups"] = [{**g, "params": [names.get(k, k) for k in g["params"]]} for g in state["param_groups"]]
    return out
