"""Pipeline parallelism: consecutive parts of the model on consecutive processes, micro-batches flowing through.

`pp` splits the model into pp_size x stages_per_rank stages (torch.distributed.pipelining; parallel/pipeline_stages.py
says how each kind of model is cut, config/pipeline.py which rank holds which stage). Each process keeps only its
stages' modules; the others are moved to the meta device. A training micro-step is one schedule step (gpipe, 1f1b,
interleaved, or the zero-bubble interleaved-zb, zbv and dualpipev) over `microbatches` slices of the batch, so
forward and backward are one call: `engine.forward_backward`. Evaluation runs the schedule forward only:
`engine.forward_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from multigpu.config.layout import AUTO, PIPELINE, TensorParallelOptions
from multigpu.config.pipeline import (
    V_SHAPED,
    ZERO_BUBBLE,
    PipelineOptions,
    check_microbatches,
    check_schedule,
    microbatch_count,
    rank_stages,
    stage_layers,
    stage_owners,
)
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.core.compute_clock import probe_s, probe_tflop
from multigpu.core.env import DistEnv, collective_device
from multigpu.core.errors import UsageError
from multigpu.parallel.experts import MixtureOfExperts
from multigpu.parallel.mesh import with_cp
from multigpu.parallel.pipeline_schedules import VStage, schedule_class
from multigpu.parallel.pipeline_stages import DecoderStage, layer_count, stage_parts
from multigpu.parallel.tensor_parallel import check_sequence_parallel, start_alike, tied_places
from multigpu.strategies.base import COMMON_FEATURES, StepOutcome, Strategy, frozen_names
from multigpu.strategies.facts import MODEL_PARALLEL, PlanRow
from multigpu.strategies.fsdp import FSDP
from multigpu.transforms.modules import repoint

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


@dataclass
class PipelineParallel(PipelineOptions, TensorParallelOptions, Strategy):
    """Pipeline stages over the layout's pp ranks; over the rest, whole replicas of the pipeline, or `inner`'s
    shards (zero2/zero3/hsdp shard each stage: the registry puts a strategy that runs beside pp inside one)."""

    inner: FSDP | None = None
    _schedules: dict = field(default_factory=dict, repr=False)
    _spread: set[int] = field(default_factory=set, repr=False)  # ep's experts' parameter ids: not the replicas'

    spread = PIPELINE
    # Its gradient collectives are its inner strategy's; the planner shows it alone where tp x pp take every GPU.
    plan_rows = (PlanRow(shown=frozenset({MODEL_PARALLEL})), PlanRow("tp+{name}", shown=frozenset({MODEL_PARALLEL})))
    pipelined = True
    # fp16: only the last stage sees the loss it scales. cpu_offload and unsharded_grad_accum: the stages' zero
    # shards neither live in host memory nor accumulate whole.
    composes_with = COMMON_FEATURES - {"fp16", "cpu_offload", "unsharded_grad_accum"}

    def check(self) -> None:
        self._per_rank = check_schedule(self.pp_schedule, self.pp_stages_per_rank)
        check_microbatches(self.pp_schedule, self.layout.pp, self._per_rank, self.pp_microbatches)
        check_sequence_parallel(self)  # an inner zero's cpu_offload and unsharded_grad_accum: composes_with

    @property
    def name(self) -> str:  # type: ignore[override]
        return "pp" if self.inner is None else f"{self.inner.name} x pp"

    @property
    def mesh_dims(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("pp", *(self.inner.mesh_dims if self.inner is not None else ()))

    def precision_plan(self, precision: Precision, device: torch.device) -> PrecisionPlan:
        """The plan of the strategy inside the stages (zero's stages cast their own parameters); no loss scaling:
        fp16-mixed is refused with the settings (composes_with has no fp16)."""
        if self.inner is not None:
            return self.inner.precision_plan(precision, device)
        return super().precision_plan(precision, device)

    def gathers_weights(self) -> bool:
        return self.inner is not None

    def expert_sharding(self, plan: PrecisionPlan) -> tuple[MixedPrecisionPolicy, bool] | None:
        return self.inner.expert_sharding(plan) if self.inner is not None else None

    def make_alike(self, model: nn.Module, env: DistEnv) -> bool:
        if self.layout.tp > 1:  # tp splits the whole model on the device; without it only the stages go there
            model.to(env.device)
        start_alike(model, env.device)  # every rank cuts its stages from the same model
        return True

    def _stage_speeds(self, model: nn.Module, env: DistEnv) -> tuple[float, ...]:
        """pp_split auto: each stage's speed, its slowest rank's on the probe (core/compute_clock.py; a stage runs
        on its row of the grid: every replica's and tp rank's copy of it). The layers are alike, so a stage's time
        is its layers over its speed; the first and last stages' embedding and head are left out of the count."""
        speed = probe_tflop(env.device.type) / probe_s(env.device)
        on = collective_device(env.device)
        speeds = [torch.empty((), dtype=torch.float64, device=on) for _ in range(dist.get_world_size())]
        dist.all_gather(speeds, torch.tensor(speed, dtype=torch.float64, device=on))
        rows = [min(float(speeds[rank]) for rank in row) for row in self._grid.tolist()]
        stages = tuple(rows[owner] for owner in self._owners)
        if dist.get_rank() == 0:
            runs = stage_layers(layer_count(model), self._stages, stages, self.pp_schedule)
            counts = ",".join(str(len(run)) for run in runs)
            print(
                f"pp_split auto -> {counts}: each stage's measured speed "
                + ", ".join(f"{speed:.3g}" for speed in stages)
                + " TFLOP/s (a matrix product each rank timed)",
                flush=True,
            )
        return stages

    def local_stages(self) -> list[nn.Module]:
        return list(getattr(self, "_forwards", []))  # made in cut_stages

    def cut_stages(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """This rank's stages of the whole model (a PipelineModel), the rest on the meta device; the optimizer left
        with their parameters (engine/parallelize.py's step before ep's last one and setup)."""
        if optimizer is not None and optimizer.state:
            raise UsageError("pp must split a fresh optimizer; call engine.setup before the first step.")
        mesh = self.build_mesh(env)
        self._group, self._device = mesh["pp"].get_group(), env.device
        pp, rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
        self._grid = mesh.mesh.reshape(pp, -1)  # a column: the ranks of one pipeline, stage by stage
        self._column = int((self._grid == dist.get_rank()).nonzero()[0, 1])
        replicated = self.inner is None and {"replicate", "cp"} & set(mesh.mesh_dim_names)
        self._replicas = with_cp(mesh, ("replicate",)).get_group() if replicated else None
        self._stages = pp * self._per_rank
        self._owners = stage_owners(self.pp_schedule, pp, self._per_rank)
        self._mine = rank_stages(self.pp_schedule, pp, self._per_rank, rank)
        # tp and ep split the whole model's layers already (engine/parallelize.py); the stages take their slices.
        split = self._stage_speeds(model, env) if (self.pp_split or "").strip() == AUTO else self.pp_split
        parts = stage_parts(model, self._stages, split, self.pp_schedule)
        kept = {name: module for stage in self._mine for name, module in parts[stage][0].items()}
        held = {id(p) for module in kept.values() for p in module.parameters()}
        ties = self._tied_groups(model, parts, rank)
        # What other stages hold goes to the meta device: its memory is given back, its shapes stay.
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) not in held:
                    module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        for module in kept.values():
            module.to(env.device)  # in place: the optimizer's Parameters stay the ones it holds
        self._forwards = [parts[stage][1](stage == 0, stage == self._stages - 1) for stage in self._mine]
        for forward in self._forwards:
            if isinstance(forward, DecoderStage) and self.sequence_parallel:
                forward.position_split = self.layout.tp
        pipeline = PipelineModel(model, kept)
        names = {id(p): name for name, p in pipeline.named_parameters()}
        # A tied weight by its name in this rank's stages: sharding replaces the Parameter, the name stays.
        self._tied = [(names[id(p)], group, count) for p, group, count in ties]
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in held]
        return pipeline, optimizer

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Wraps the stages cut_stages made (`model`, their PipelineModel; ep's experts held already): zero inside
        each stage, or whole replicas of the pipeline, which average every gradient but ep's experts'."""
        names = {id(p): name for name, p in model.named_parameters()}
        if self.layout.ep > 1:
            from multigpu.parallel.expert_parallel import is_spread

            self._spread = {id(p) for p in model.parameters() if is_spread(p)}
        if self.inner is not None:
            self._shard_stages(model.module, plan)
            repoint(optimizer, names, model)
        current = dict(model.named_parameters())
        self._ties = [(current[name], group, count) for name, group, count in self._tied]
        return model, optimizer

    def _shard_stages(self, model: nn.Module, plan: PrecisionPlan) -> None:
        """zero2/zero3/hsdp inside each stage: the whole model's units that the stage holds, then the stage as
        their root (which the schedule tells when a step's last backward has run)."""
        units = self.inner.units(model)
        tied = [(place, first, getattr(*first)) for place, first in tied_places(model)]
        # torch 2.13's split backward reads a stage's parameters again at its weight half: resharded by another
        # micro-batch's forward in between, their gradients are lost. A zero-bubble schedule's stages therefore keep
        # their weights gathered from the forward to the step's last weight half, as torchtitan's pipelines do.
        resharding = self.inner.reshard_after_forward
        reshard = resharding and self.pp_schedule not in ZERO_BUBBLE
        if resharding and not reshard and dist.get_rank() == 0:
            print(
                f"{self.name} under pp_schedule {self.pp_schedule}: each stage's weights stay gathered from its "
                "forward to the step's last weight half (torch's split backward needs them); gradients and optimizer "
                "states stay sharded",
                flush=True,
            )
        for forward in self._forwards:
            inside = {id(m) for m in forward.modules()}
            # On this strategy's mesh: zero's "shard" (and "replicate") dimensions are slices of it.
            self.inner.shard_stage(forward, [u for u in units if id(u) in inside], plan, self.mesh, reshard)
        # A tied weight's name outside this rank's stages (the embedding's, on the last stage) follows the
        # Parameter that sharding put in place of the one both names held.
        for place, first, old in tied:
            new = getattr(*place) if getattr(*place) is not old else getattr(*first)
            setattr(*place, new)
            setattr(*first, new)

    def _tied_groups(self, model: nn.Module, parts: list, rank: int) -> list[tuple[nn.Parameter, Any, int]]:
        """This rank's parameters that two stages share (a head tied to the embeddings), each with the process group
        of the ranks of this pipeline that hold it, and their number: their gradients are summed there after
        backward, so both copies step alike. (In a V, rank 0 holds the first and the last stage: one copy.)"""
        holders: dict[int, set[int]] = {}
        by_id = {id(p): p for p in model.parameters()}
        for stage, (kept, _) in enumerate(parts):
            for module in kept.values():
                for p in module.parameters():
                    holders.setdefault(id(p), set()).add(self._owners[stage])
        ties = []
        for pid, ranks in holders.items():
            if len(ranks) > 1:
                # Every rank makes every pipeline's group, in the same order, and keeps its own pipeline's.
                for column in range(self._grid.shape[1]):
                    group = dist.new_group(sorted(int(self._grid[r, column]) for r in ranks))
                    if column == self._column and rank in ranks:
                        ties.append((by_id[pid], group, len(ranks)))
        return ties

    def holders(self, param: torch.Tensor) -> int:
        # The ranks of the other pipelines hold the same stage, less those among them that hold other shards of it.
        shards = 1
        if isinstance(param, DTensor):
            placements = zip(param.placements, param.device_mesh.shape, strict=True)
            shards = math.prod(size for placement, size in placements if not placement.is_replicate())
        tied = next((count for p, _, count in self._ties if p is param), 1)
        return tied * self._grid.shape[1] // shards

    # -- one micro-step --------------------------------------------------------------------------------------------
    def pipeline_step(
        self,
        inputs: Any,
        targets: torch.Tensor,
        loss_fn: LossFn,
        weigh: Callable[[Any, float], Any],
        train: bool,
        experts: MixtureOfExperts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the schedule over `inputs` (forward and backward when `train`, forward only otherwise); returns the
        loss (summed over micro-batches when loss_fn gives (sum, count), else the batch's mean) and the count, both
        on every rank. `weigh(loss_fn's result, the micro-batch's share of the batch's rows)` gives the scalar each
        micro-batch's backward starts from; `experts`, the model's mixture, whose load-balancing loss each
        micro-batch weighs its share of."""
        args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
        args = args if isinstance(args, tuple) else (args,)
        shapes = tuple(tuple(t.shape) for t in [*args, *kwargs.values(), targets] if torch.is_tensor(t))
        rows = len(targets)
        # A batch whose rows the wanted count does not divide (a short last batch) takes the largest that does.
        pp, wanted = self._stages // self._per_rank, self.pp_microbatches or self._stages
        # Evaluating, dualpipev runs zbv's order (schedule_class), which takes any count.
        counted = "zbv" if self.pp_schedule == "dualpipev" and not train else self.pp_schedule
        micro = microbatch_count(counted, pp, self._per_rank, wanted, rows)
        results: list = []

        def stage_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            result = loss_fn(output, target)
            results.append((result, len(target) / rows))
            return weigh(result, len(target) / rows)

        kind = self._schedule_kind(micro, train)
        new = (shapes, micro, kind) not in self._schedules
        schedule = self._schedule(shapes, micro, kind)
        schedule._loss_fn = stage_loss  # the schedule keeps one loss function; this step's is the caller's
        run = schedule.step if train else schedule.eval
        # A new schedule's first run infers its shapes by a real forward and backward, after which torch drops the
        # sharded stages' gradients: those of this accumulation's earlier batches wait aside meanwhile.
        aside = self._gradients_aside() if new and train and self.inner is not None else []
        if experts is not None and train:
            experts.pipeline_slices(micro, summed=False)
        run(*args, target=targets, losses=[], **kwargs)
        with torch.no_grad():
            for param, grad in aside:
                param.grad = grad if param.grad is None else param.grad + grad
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
        if experts is not None and train and summed:
            experts.pipeline_slices(1, summed=True)  # refuses a count it could not know beforehand
        return (loss, count) if summed else (loss, None)

    def _gradients_aside(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """This rank's stages' gradients, each taken off its parameter."""
        aside = []
        for forward in self._forwards:
            for param in forward.parameters():
                if param.grad is not None:
                    aside.append((param, param.grad))
                    param.grad = None
        return aside

    def _schedule(self, shapes: tuple, micro: int, kind: type) -> Any:
        """The schedule for batches of these shapes: a stage sizes its buffers at its first step, so each new
        shape (a shorter last batch) gets stages of its own."""
        if (shapes, micro, kind) not in self._schedules:
            make = VStage if self.pp_schedule in V_SHAPED else PipelineStage
            stages = [
                make(forward, stage, self._stages, self._device, group=self._group)
                for forward, stage in zip(self._forwards, self._mine, strict=True)
            ]
            schedule = kind(stages if len(stages) > 1 else stages[0], micro, loss_fn=lambda o, t: o, scale_grads=False)
            self._schedules[(shapes, micro, kind)] = schedule
        return self._schedules[(shapes, micro, kind)]

    def _schedule_kind(self, micro: int, train: bool) -> type:
        """The configured schedule (schedule_class), or for a batch too short for 1f1b or interleaved (fewer
        micro-batches than 1f1b has stages, or than interleaving fills in whole rounds) the all-forwards-then-all-
        backwards order: the same gradients, and no more activations in flight than the configured schedule would
        hold with enough micro-batches. (The zero-bubble schedules refuse such batches: microbatch_count.)"""
        return schedule_class(self.pp_schedule, self._stages // self._per_rank, self._per_rank, micro, train)

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, *args: Any) -> StepOutcome:
        if self._replicas is not None:  # whole replicas of the pipeline average their gradients, as ddp's do
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and id(p) not in self._spread:  # ep's experts: averaged by hook
                        by_dtype.setdefault(p.grad.dtype, []).append(_local(p.grad))
            with torch.no_grad():
                for same in by_dtype.values():  # one all-reduce per dtype, of every gradient laid end to end
                    flat = torch.cat([g.reshape(-1) for g in same])
                    dist.all_reduce(flat, group=self._replicas)
                    flat /= dist.get_world_size(self._replicas)
                    for grad, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
                        grad.copy_(part.view_as(grad))
        for param, group, _ in self._ties:  # the embedding's and the head's shares of a tied weight's gradient
            if param.grad is None:
                continue
            if isinstance(param, DTensor) and param.grad.placements != param.placements:
                # A split embedding's gradient comes back whole; the head's is split like the weight they share.
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(_local(param.grad), group=group)
        return super().optimizer_step(model, optimizer, *args)

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
        # Split and sharded weights are assembled within each stage (every rank of it joins), then rank 0's
        # pipeline gathers its stages' whole weights; the other pipelines hold the same.
        state = {k: v for k, v in model.state_dict().items() if k not in left_out}
        mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}
        if self._column != 0:
            return {}
        gathered: list = [None] * dist.get_world_size(self._group) if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._group)
        return {k: v for part in gathered for k, v in part.items()} if gathered else {}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    if not names:
        return state
    out = dict(state)
    out["state"] = {names.get(k, k): v for k, v in state["state"].items()}
    out["param_groups"] = [{**g, "params": [names.get(k, k) for k in g["params"]]} for g in state["param_groups"]]
    return out
