"""The small interface every strategy implements: lay out the processes, wrap, skip gradient sync, scale, measure
the gradient norm."""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from multigpu.config.layout import ALONE, ParallelDims, Spread
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.core.env import DistEnv, grouped
from multigpu.core.errors import UsageError
from multigpu.core.lazy import is_dtensor
from multigpu.parallel.mesh import build_mesh
from multigpu.strategies.facts import Facts, PlanRow
from multigpu.transforms.modules import MetaValues, default_units, parameters_on_meta

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

#: What most strategies run with (strategies/compatibility.py says what turns each on).
COMMON_FEATURES = frozenset(
    {"fp16", "bf16_true", "muon", "low_bit_optimizer", "cpu_offload", "unsharded_grad_accum"}
    | {"head_after_forward", "compile", "activation_checkpointing", "sync_batchnorm"}
)


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float | None  # the global gradient norm before clipping, when clipping is on
    applied: bool  # False when fp16 loss scaling found inf/nan gradients and skipped the update


@dataclass
class Strategy(ABC):
    """What one way of spreading training over processes does: lay them out (`spread`, resolved into `layout`),
    wrap the model and optimizer, skip gradient synchronisation, scale, clip, measure and save.

    A strategy is built whole from its constructor arguments (strategies/__init__.py: the registry): the resolved
    layout, and its own options, which are the fields of the option groups it inherits (config/layout.py).
    """

    #: Every degree of the job, resolved from the request and the world size (config/layout.py: resolve_layout).
    layout: ParallelDims = field(default_factory=ParallelDims)

    name: ClassVar[str]
    #: How the strategy lays out the processes the degrees asked for leave, and beside which dimensions it runs.
    spread: ClassVar[Spread] = ALONE
    #: Whether a model built under engine.init_module stays on the meta device until setup, which then gives each
    #: rank only its shards (zero2/zero3); elsewhere every rank needs the whole model, built as usual.
    builds_on_meta: ClassVar[bool] = False
    #: Whether the micro-steps of an accumulation window run under `no_sync`, communicating only on the last.
    accumulates_unsynced: ClassVar[bool] = True
    #: The mesh dimensions the strategy works on (see mesh.py); its mesh has them even at degree 1. Empty: no mesh,
    #: for one-process strategies and for DeepSpeed, which makes its own groups.
    mesh_dims: ClassVar[tuple[str, ...]] = ()
    #: Whether a micro-step is one call through a schedule (pp: pipeline_step), not a forward and a backward.
    pipelined: ClassVar[bool] = False
    #: Options of a group it inherits that it does not take (zero2 inherits zero3's, but cannot offload).
    not_taken: ClassVar[tuple[str, ...]] = ()
    #: What it shards, holds, communicates and can run (strategies/facts.py): the planner, simulator and bench read it.
    facts: ClassVar[Facts] = Facts()
    #: The rows `multigpu plan` shows for it (none: it is not planned).
    plan_rows: ClassVar[tuple[PlanRow, ...]] = ()
    #: The features (strategies/compatibility.py's FEATURES, not degrees: `spread.takes` has those) it runs with;
    #: the table refuses the others. Most run with COMMON_FEATURES; powersgd and shared GPUs are DDP's own.
    composes_with: ClassVar[frozenset[str]] = COMMON_FEATURES
    #: Built by `build_mesh` before the model is split (engine/parallelize.py); None until then and for strategies
    #: without mesh_dims.
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, say: Callable[[str], None], **arguments: Any) -> Strategy:
        """The strategy made of the registry's constructor arguments. A strategy may run as another where this
        machine cannot run it, and say so through `say` (dp on fewer than two GPUs runs as single)."""
        return cls(**arguments)

    @property
    def needs_process_group(self) -> bool:
        """False only for strategies that run in one process and need no torch.distributed group."""
        return bool(self.spread.fills)

    def check_runnable(self, device: torch.device, plan: PrecisionPlan) -> None:
        """Refuses, in one sentence and before any process starts, what this strategy cannot run on `device`."""
        return None  # most run anything their options and precision plan allowed

    def communication_state(self) -> Any:
        """State this rank keeps for its gradient communication, saved in checkpoints (ddp's PowerSGD); None."""
        return None

    def load_communication_state(self, read: Callable[[int], Any], rank: int) -> None:
        """Puts back what communication_state saved; `read(r)` is rank r's (None where none was saved)."""
        return None

    def local_stages(self) -> list[nn.Module]:
        """The pipeline stages this rank runs once set up (each an FSDP root under zero2/zero3); none but pp's."""
        return []

    def precision_plan(self, precision: Precision, device: torch.device) -> PrecisionPlan:
        """What `precision` means under this strategy (or one sentence refusing it): by default the Engine's
        autocast computes in the mixed dtype, parameters are stored in the precision's, and fp16 scales the loss."""
        scaler = (lambda: torch.amp.GradScaler(device.type)) if precision.needs_grad_scaler else None
        return PrecisionPlan(precision, precision.compute_dtype, precision.param_dtype, scaler)

    def build_context(self, env: DistEnv, plan: PrecisionPlan) -> contextlib.AbstractContextManager[None]:
        """What engine.init_module builds the model inside: parameters on the meta device where setup shards it
        from there (builds_on_meta), else nothing special."""
        return parameters_on_meta() if self.builds_on_meta else contextlib.nullcontext()

    def build_mesh(self, env: DistEnv) -> DeviceMesh | None:
        """The strategy's mesh, built on the first call (engine/parallelize.py's, before tp) and the same object
        after that."""
        if self.mesh is None and self.mesh_dims:
            self.mesh = build_mesh(self.layout, env.device.type, keep=self.mesh_dims)
        return self.mesh

    def make_alike(self, model: nn.Module, env: DistEnv) -> bool:
        """Before tp and ep split the model (engine/parallelize.py): puts it where they find it and gives every rank
        rank 0's weights, where the strategy's own wrapping would not (fully_shard, tp and a pipeline's cuts take
        their slices of what each rank holds); returns whether it did. DDP and DeepSpeed broadcast as they wrap."""
        return False

    # What engine/parallelize.py asks of the strategy, step by step.
    def splits_layers(self) -> bool:
        """Whether the tp step splits the model's layers over a tp dimension of the strategy's mesh (there is one
        wherever the layout has tp, or the strategy works on that dimension)."""
        return bool(self.mesh_dims) and (self.layout.tp > 1 or "tp" in self.mesh_dims)

    def splits_sequence(self) -> bool:
        """Whether the tp step also splits a decoder's norms and residual stream by position (sequence_parallel)."""
        return False

    def finds_unused_parameters(self) -> bool:
        """Whether the strategy lets parameters go without a gradient in a step (ddp's find_unused_parameters)."""
        return False

    def gathers_weights(self) -> bool:
        """Whether the strategy shards the weights and gathers each unit's before it runs (zero2, zero3, hsdp, in
        pipeline stages too): float8 then gathers them in float8, and compile keeps static shapes under tp."""
        return False

    def unit_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The blocks recomputation and compile wrap: the model's own, or the units a sharding strategy shards, so
        that its hooks run around a recomputed block."""
        return default_units(model)

    def sharded_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every module the strategy wraps apart (zero's units and 4-bit layers): selective recomputation cannot run
        where one of them sits inside a block."""
        return self.unit_blocks(model)

    def cut_stages(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """A pipeline's stages cut from the whole model, after compile: what setup then wraps, and the optimizer
        left with their parameters. Nothing to cut but for pp."""
        return model, optimizer

    def expert_sharding(self, plan: PrecisionPlan) -> tuple[MixedPrecisionPolicy, bool] | None:
        """How the ranks that hold the same experts once ep spread them keep them (parallel/expert_parallel.py:
        hold_experts): the policy and reshard_after_forward of an FSDP unit over them for each layer's experts
        (zero2, zero3, hsdp), or None: they replicate them, their gradients averaged by hook."""
        return None

    @abstractmethod
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Moves the model to its device and wraps model and optimizer (the last step of engine/parallelize.py:
        tp and ep have split it, cut_stages cut it and hold_experts readied ep's experts by then); returns what the
        loop must use."""

    def setup_from_meta(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        env: DistEnv,
        plan: PrecisionPlan,
        values: MetaValues,
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """setup for a model still on the meta device (builds_on_meta strategies): each rank gets only its shards,
        their values made by `values` on one rank."""
        raise NotImplementedError(f"{self.name} builds whole models; the engine materialises them before setup")

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward accumulates local gradients without communicating."""
        return contextlib.nullcontext()

    def updates(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
        """Whether `optimizer` (as setup returned it) updates `module`'s parameters."""
        first = next(p for group in optimizer.param_groups for p in group["params"])
        return any(p is first for p in module.parameters())

    def backward(self, model: nn.Module, loss: torch.Tensor, syncs: bool) -> None:
        """Backward of the (already weighted and scaled) loss; `syncs` is False inside an accumulation window."""
        loss.backward()

    def optimizer_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        count: float | None,
        max_grad_norm: float | None,
    ) -> StepOutcome:
        """Unscales, divides by the step's `count` (when the loss was a sum), clips, steps and zeroes the
        gradients; reports the gradient norm before clipping (when clipping is on) and whether the step applied."""
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if count is not None:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(max(count, 1.0))
        norm = None
        if max_grad_norm is not None:
            norm = self.total_grad_norm(params)
            for group in by_mesh(params, lambda p: p.grad).values():
                torch.nn.utils.clip_grads_with_norm_(group, max_grad_norm, norm)
        applied = True
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            # The scaler skips the update when it finds inf/nan gradients, and only then lowers the scale.
            applied = scaler.get_scale() >= scale
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(None if norm is None else float(norm), applied)

    def total_grad_norm(self, parameters: Iterable[nn.Parameter]) -> torch.Tensor:
        """The 2-norm of all gradients of the *whole* model, the same on every rank."""
        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        # Each rank adds up the squares of what it holds, each divided by the number of ranks that hold the same
        # elements (DTensors' replicated mesh dimensions; whole tensors are the same on every rank), and one
        # all-reduce sums them. One sum, so every rank gets the same norm bitwise, whatever mix of plain tensors
        # and DTensors on different meshes tensor parallelism and zero3 make.
        by_copies: dict[int, list[torch.Tensor]] = {}
        for param in parameters:
            if param.grad is not None:
                local = param.grad.to_local() if is_dtensor(param.grad) else param.grad
                by_copies.setdefault(self.holders(param), []).append(local)
        device = grads[0].device if grads else (parameters[0].device if parameters else torch.device("cpu"))
        square = torch.zeros((), dtype=torch.float64, device=device)
        for copies, group in by_copies.items():
            square += torch.nn.utils.get_total_norm(group, 2.0).double().to(device) ** 2 / copies
        if grouped():  # every rank joins, those without gradients too
            dist.all_reduce(square)
        return square.sqrt().float()

    def holders(self, param: torch.Tensor) -> int:
        """How many ranks hold each element of `param` (and so of its gradient)."""
        return holders(param)

    # State dicts keyed by parameter names, sharded as the strategy holds them (DTensors under FSDP), so that
    # torch.distributed.checkpoint can reshard them for any other world size or strategy on load. Frozen
    # parameters (a LoRA run's base model) never change, so checkpoints leave them out. DCP is imported at the
    # first call: importing it costs each process ~0.6 s of CPU, and a run that saves nothing need not pay it.
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # torch's ignore_frozen_params keeps a tied weight's second name (a head tied to the embeddings).
        frozen = frozen_names(model)
        state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        return {key: value for key, value in state.items() if key not in frozen}

    def model_state_to_load(self, model: nn.Module) -> dict[str, Any]:
        """The tensors a checkpoint's model state is loaded into (`model_state_dict`'s, unless a strategy keeps
        parts of that on some ranks only)."""
        return self.model_state_dict(model)

    def full_state_dict(self, model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
        """Whole weights and buffers on rank 0's CPU (nothing on the other ranks), assembled one at a time, keyed as
        the plain model, frozen weights left out with `trainable_only`; for writing a model or adapter out. Every
        rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(model, options=options)
        frozen = frozen_names(model) if trainable_only else set()
        return {key: value for key, value in state.items() if key not in frozen}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        keys = set_model_state_dict(model, state, options=StateDictOptions(strict=False))
        frozen = frozen_names(model)
        # Keyed as the wrapped module is (DDP's "module." prefix), as frozen_names is not.
        missing = [key for key in keys.missing_keys if key.removeprefix("module.") not in frozen]
        if missing or keys.unexpected_keys:
            raise UsageError(
                f"The checkpoint does not fit this model (missing {missing[:3]}, unexpected "
                f"{keys.unexpected_keys[:3]}); resume with the model it was saved from."
            )

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer)

    def optimizer_state_to_load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state)


def holders(tensor: torch.Tensor) -> int:
    """How many ranks hold each element of `tensor`: all ranks over the pieces a DTensor is sharded into (its
    mesh may span fewer ranks than all: experts over the ep ranks are held alike by every ep group), all ranks
    for a whole tensor."""
    if not is_dtensor(tensor):
        return dist.get_world_size() if grouped() else 1
    placements = zip(tensor.placements, tensor.device_mesh.shape, strict=True)
    # Anything but Replicate splits: zero3's _StridedShard of a tp slice is no is_shard() to torch.
    return dist.get_world_size() // math.prod(size for placement, size in placements if not placement.is_replicate())


def by_mesh(items: list, tensor_of: Callable[[Any], Any]) -> dict[object, list]:
    """`items` grouped by the mesh of their tensor (None: plain tensors). torch's norm and foreach calls take one
    kind at a time, and tensor parallelism mixes them: whole tensors (layers left whole) and DTensors on two meshes
    (tp's splits, and zero3's shards of those on shard x tp)."""
    groups: dict[object, list] = {}
    for item in items:
        tensor = tensor_of(item)
        if tensor is not None:
            groups.setdefault(tensor.device_mesh if is_dtensor(tensor) else None, []).append(item)
    return groups


def frozen_names(model: nn.Module) -> set[str]:
    """Every name of every parameter that does not train, tied names included, as state dicts key them."""
    named = model.named_parameters(remove_duplicate=False)
    return {name.removeprefix("module.") for name, p in named if not p.requires_grad}


def is_quantized(param: torch.Tensor) -> bool:
    """Packed low-bit weights (bitsandbytes' 4-bit Params4bit): bytes that hold codes, never to be cast."""
    return getattr(param, "quant_state", None) is not None or getattr(param, "bnb_quantized", False)


def move_to_device(model: nn.Module, env: DistEnv) -> nn.Module:
    # In-place `.to` keeps the Parameter objects, so an optimizer built before setup stays valid.
    return model.to(env.device)
