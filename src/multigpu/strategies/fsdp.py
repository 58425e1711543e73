"""ZeRO-2 and ZeRO-3 through FSDP2 `fully_shard`: parameters, gradients and optimizer states sharded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from multigpu.config.layout import SHARDS, ShardingOptions, TensorParallelOptions
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError, require
from multigpu.parallel.compression import CompressionOptions
from multigpu.parallel.grad_scaler import DTensorGradScaler
from multigpu.parallel.mesh import with_cp
from multigpu.parallel.shard_fill import fill_shards
from multigpu.parallel.tensor_parallel import check_sequence_parallel, start_alike
from multigpu.strategies.base import COMMON_FEATURES, Strategy, is_quantized
from multigpu.strategies.facts import (
    BESIDE_MODEL_PARALLEL,
    DATA_PARALLEL,
    FSDP_SLICES,
    GATHERED_MODEL,
    ONE_GPU,
    REDUCE_SCATTER,
    STATES,
    TWO_UNITS,
    Communication,
    Facts,
    MemoryModel,
    PlanRow,
)
from multigpu.transforms.modules import MetaValues, check_ties, default_units, repoint

UnitSelector = Callable[[nn.Module], list[nn.Module]]
#: The plans zero2's and zero3's rows are shown in, and those that may recommend them.
EVERYWHERE = frozenset({ONE_GPU, DATA_PARALLEL, BESIDE_MODEL_PARALLEL})
SEVERAL = frozenset({DATA_PARALLEL, BESIDE_MODEL_PARALLEL})


def children_first(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """`units` ordered so that every unit comes after the units nested inside it: fully_shard must wrap a module's
    children before the module itself. Units at the same depth keep their order."""
    depth = {id(module): name.count(".") + 1 if name else 0 for name, module in model.named_modules()}
    unique = list({id(unit): unit for unit in units}.values())
    return sorted(unique, key=lambda unit: -depth[id(unit)])


def quantized_owners(model: nn.Module) -> list[nn.Module]:
    """The modules that hold packed low-bit weights (bitsandbytes' 4-bit layers) as their own parameters."""
    return [module for module in model.modules() if any(is_quantized(p) for p in module.parameters(recurse=False))]


@dataclass(frozen=True)
class FSDPPrecision(PrecisionPlan):
    """FSDP casts parameters itself, per unit: no autocast; each unit gathers its parameters in the mixed dtype and
    reduces gradients in fp32 (or grad_compression's bf16 or fp16), and the root casts its output back to fp32 so
    that losses are computed at full width. A unit of packed 4-bit weights gathers them as they are (`whole`): a
    cast would scramble their bytes."""

    unit: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    root: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    whole: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)


@dataclass
class FSDP(CompressionOptions, ShardingOptions, TensorParallelOptions, Strategy):
    #: True frees the gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2).
    reshard_after_forward: bool = True
    units: UnitSelector = default_units

    spread = SHARDS
    facts = Facts(
        MemoryModel(STATES, temporary=TWO_UNITS, build=FSDP_SLICES), Communication(REDUCE_SCATTER, per_unit=True)
    )
    plan_rows = (
        PlanRow(order=6, shown=EVERYWHERE, recommended=SEVERAL, reference=True),
        # cpu_offload keeps the sharded states in host memory: the slowest, recommended only where allowed.
        PlanRow(
            "{name}+offload",
            (("cpu_offload", True),),
            replace(facts.memory, offload=True),
            order=7,
            shown=frozenset({ONE_GPU, DATA_PARALLEL}),
            recommended=frozenset({ONE_GPU, DATA_PARALLEL}),
        ),
    )
    mesh_dims = ("shard",)
    composes_with = COMMON_FEATURES | {"fault_tolerance"}  # no powersgd: FSDP2 has no communication hook

    def check(self) -> None:
        require(
            (
                not self.cpu_offload or self.reshard_after_forward,
                "cpu_offload works with strategy zero3 or hsdp only, not zero2; drop it or use zero3.",
            )
        )
        check_sequence_parallel(self)  # powersgd is refused with the settings: composes_with has none

    @property
    def builds_on_meta(self) -> bool:  # type: ignore[override]
        # Filling shards from one rank (fill.py) knows the rows of one sharded dimension, not tp's or ep's splits.
        return self.layout.tp == 1 and self.layout.ep == 1

    @property
    def name(self) -> str:  # type: ignore[override]
        return "zero3" if self.reshard_after_forward else "zero2"

    def check_runnable(self, device: torch.device, plan: PrecisionPlan) -> None:
        if self.cpu_offload and device.type != "cuda":
            raise UsageError(
                "cpu_offload moves sharded parameters from the GPU to CPU memory, but this run is on CPU "
                "already; drop cpu_offload or run on GPUs."
            )

    def precision_plan(self, precision: Precision, device: torch.device) -> FSDPPrecision:
        # grad_compression bf16/fp16 is the dtype gradients are reduced in, whatever the parameters' (FSDP2 casts
        # them for the reduce-scatter and back to the parameters' dtype after).
        compute, reduce, policies = precision.compute_dtype, self.compression.reduce_dtype, {}
        if compute is not None:
            reduce = reduce or torch.float32
            policies = {
                "unit": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce),
                "root": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, output_dtype=torch.float32),
            }
        elif reduce is not None:
            policies = {name: MixedPrecisionPolicy(reduce_dtype=reduce) for name in ("unit", "root", "whole")}
        scaler = (lambda: DTensorGradScaler(device=device.type)) if precision.needs_grad_scaler else None
        return FSDPPrecision(precision, None, precision.param_dtype, scaler, **policies)

    def gathers_weights(self) -> bool:
        return True

    def unit_blocks(self, model: nn.Module) -> list[nn.Module]:
        return self.units(model)

    def sharded_modules(self, model: nn.Module) -> list[nn.Module]:
        return [*self.units(model), *quantized_owners(model)]

    def expert_sharding(self, plan: PrecisionPlan) -> tuple[MixedPrecisionPolicy, bool]:
        assert isinstance(plan, FSDPPrecision)  # precision_plan's
        return plan.unit, self.reshard_after_forward

    def make_alike(self, model: nn.Module, env: DistEnv) -> bool:
        if not self.cpu_offload:  # offloaded, the parameters stay in CPU memory (start_alike sends them through it)
            model.to(env.device)
        # fully_shard slices whatever each rank holds; unlike DDP it does not broadcast rank 0's weights.
        start_alike(model, env.device)
        return True

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        names = {id(p): name for name, p in model.named_parameters()}
        # ep's experts are units of their own already (engine/parallelize.py: hold_experts).
        units, shard = self._wrapping(model, optimizer, env, plan)
        for unit in [*units, model]:
            shard(unit)
        # fully_shard replaced every Parameter with a sharded DTensor one; point the optimizer at those.
        repoint(optimizer, names, model)
        return model, optimizer

    def setup_from_meta(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        env: DistEnv,
        plan: PrecisionPlan,
        values: MetaValues,
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Shards `model` while it is still on the meta device, gives each rank storage for its shards only, and
        fills them from the rank that makes the values (fill.py): no rank ever holds the whole model."""
        names = {id(p): name for name, p in model.named_parameters()}
        units, shard = self._wrapping(model, optimizer, env, plan)
        wanted = {id(unit) for unit in units}
        unit_names = {name for name, module in model.named_modules() if id(module) in wanted} | {""}
        for unit in [*units, model]:
            shard(unit)
        model.to_empty(device="cpu" if self.cpu_offload else env.device)
        for module in model.modules():  # offloaded or not, the layers compute on the device, buffers included
            module._buffers.update({n: b.to(env.device) for n, b in module._buffers.items() if b is not None})
        fill_shards(model, values, unit_names, self.sharding_mesh(), env.device)
        repoint(optimizer, names, model)
        return model, optimizer

    def _wrapping(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: PrecisionPlan
    ) -> tuple[list[nn.Module], Callable[[nn.Module], None]]:
        """The units to shard, children first, and what shards one (the model itself last, as the root)."""
        if optimizer is not None and optimizer.state:
            raise UsageError(f"{self.name} must shard a fresh optimizer; call engine.setup before the first step.")
        self.build_mesh(env)
        units = self.units(model)
        check_ties(model, units)
        return children_first(model, [*units, *quantized_owners(model)]), self.sharder(model, plan, keep_root=True)

    def shard_stage(
        self, stage: nn.Module, units: list[nn.Module], plan: FSDPPrecision, mesh: DeviceMesh, reshard: bool
    ) -> None:
        """Shards one pipeline stage (pp.py): `units` (those of the whole model that the stage holds) and then the
        stage itself, the root whose pre-forward gathers what no unit holds (embeddings, norm, head); over the
        pipeline's `mesh` (this strategy's dimensions are slices of it), resharding after forward as `reshard` says
        (the pipeline's schedule decides)."""
        check_ties(stage, units)
        shard = self.sharder(stage, plan, on=(self.sharding_mesh(mesh), reshard))
        for unit in [*children_first(stage, [*units, *quantized_owners(stage)]), stage]:
            shard(unit)

    def sharder(
        self,
        root: nn.Module,
        plan: FSDPPrecision,
        keep_root: bool = False,
        on: tuple[DeviceMesh, bool] | None = None,
    ) -> Callable[[nn.Module], None]:
        """What shards one unit of the tree under `root` (and `root` itself, last), with the plan's casts, over `on`'s
        mesh with its reshard_after_forward (by default the strategy's own).
        `keep_root`: the root keeps its parameters gathered from forward to backward, FSDP2's own default for a root
        (a model's, not a pipeline stage's, whose schedule runs several forwards first): its backward begins at once
        and would gather them again, one all-gather a step more than a plain fully_shard loop."""
        mesh, reshard = on or (self.sharding_mesh(), self.reshard_after_forward)
        common = {"mesh": mesh, "reshard_after_forward": reshard}
        if self.cpu_offload:
            common["offload_policy"] = CPUOffloadPolicy()
        # Packed 4-bit weights are bytes, not numbers: their layers are units of their own that gather the storage
        # as it is; the layers dequantise it themselves.
        quantized = quantized_owners(root)

        def shard(unit: nn.Module) -> None:
            policy = plan.whole if any(unit is q for q in quantized) else plan.unit
            kept = {"reshard_after_forward": False} if keep_root and unit is root else {}
            fully_shard(unit, mp_policy=plan.root if unit is root else policy, **{**common, **kept})

        return shard

    def sharding_mesh(self, mesh: DeviceMesh | None = None) -> DeviceMesh:
        """The mesh fully_shard lays parameters out on, of `mesh` (a pipeline's) or the strategy's own. It reads a
        2-D ("replicate", "shard") mesh as HSDP (shards within each replica group, gradients averaged across
        groups): an hsdp strategy returns that here."""
        return with_cp(mesh or self.mesh, ("shard",))

    @property
    def accumulates_unsynced(self) -> bool:  # type: ignore[override]
        return self.unsharded_grad_accum

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return _without_gradient_sync(model)


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass
class Zero2(FSDP):
    """ZeRO-2: FSDP keeping the gathered parameters from forward until backward."""

    reshard_after_forward: bool = False
    not_taken = ("cpu_offload",)
    facts = Facts(
        MemoryModel(STATES, temporary=GATHERED_MODEL, build=FSDP_SLICES),
        Communication(REDUCE_SCATTER, gathers_after_step=True),
    )
    plan_rows = (PlanRow(order=4, shown=EVERYWHERE, recommended=SEVERAL),)
