"""ZeRO stages 1-3 through DeepSpeed (an optional dependency), behind the same Engine calls as every strategy.

The Engine keeps what it owns for every strategy: the data order, the loss weighting that makes each step's
gradient the mean over its global batch, the accumulation boundaries and its resharding checkpoint format.
DeepSpeed partitions, reduces and clips the gradients and takes the optimizer step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from multigpu.config.layout import OWN_GROUPS
from multigpu.config.precision import Precision, PrecisionPlan
from multigpu.config.settings import StrategyOptions, setting
from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError, require
from multigpu.parallel.deepspeed_config import completed_config
from multigpu.strategies.base import COMMON_FEATURES, StepOutcome, Strategy, frozen_names
from multigpu.strategies.facts import (
    AUTOCAST,
    DATA_PARALLEL,
    PARTITIONED,
    TWO_UNITS,
    WHOLE,
    Facts,
    MemoryModel,
    PlanRow,
)
from multigpu.transforms.modules import give_back_freed_memory

INSTALL = "pip install 'multigpu[deepspeed]'"


@dataclass
class DeepSpeedOptions(StrategyOptions):
    """The options of strategy deepspeed; the Engine, `multigpu train` and `multigpu finetune` all take them."""

    zero_stage: int | None = setting(
        None, "deepspeed: ZeRO stage (default: the config file's, else 2)", choices=(1, 2, 3)
    )
    offload_optimizer: bool = setting(False, "deepspeed: keep optimizer states in CPU memory and step there")
    offload_param: bool = setting(False, "deepspeed stage 3: keep parameters in CPU memory")
    deepspeed_config: str | None = setting(None, "deepspeed: a DeepSpeed JSON config to start from", metavar="JSON")

    def check(self) -> None:
        # offload_param with a zero_stage other than 3: strategies/compatibility.py's table of what composes.
        require((self.zero_stage in (None, 1, 2, 3), f"zero_stage must be 1, 2 or 3 (got {self.zero_stage})."))


@dataclass(frozen=True)
class DeepSpeedPrecision(PrecisionPlan):
    """DeepSpeed's precision: fp16 is its own (fp16 weights with fp32 masters, its own loss scaling, inputs cast),
    given as its config's section; bf16-mixed is the Engine's autocast over DeepSpeed's fp32 weights."""

    section: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeepSpeed(DeepSpeedOptions, Strategy):
    #: DeepSpeed clips inside its step, so it must know the limit when it is set up.
    max_grad_norm: float | None = None

    name = "deepspeed"
    # Its own layout: deepspeed.initialize makes its own data-parallel groups over the default one (every process a
    # ZeRO partition), so it builds no torch mesh, which would only add communicators nothing uses.
    spread = OWN_GROUPS
    # An optional backend: planned and reported at each ZeRO stage, never recommended.
    facts = Facts(MemoryModel(partitions=True), optional=True, flat_partitions=True)
    plan_rows = tuple(
        PlanRow(
            f"{{name}}{stage}",
            (("zero_stage", stage),),
            MemoryModel(
                frozenset(("optimizer", "grads", "params")[:stage]),
                partitions=True,
                temporary=TWO_UNITS if stage == 3 else AUTOCAST,
                build=PARTITIONED if stage == 3 else WHOLE,
            ),
            order=7 + stage,
            shown=frozenset({DATA_PARALLEL}),
        )
        for stage in (1, 2, 3)
    )
    # fp32 master weights; ZeRO steps flat partitions of many parameters, where Muon finds no matrix and torchao's
    # low-bit states no tensor of their own; ZeRO-3 releases the output head's weight after forward.
    composes_with = COMMON_FEATURES - {"bf16_true", "muon", "low_bit_optimizer", "head_after_forward"}

    @classmethod
    def build(cls, say: Callable[[str], None], **arguments: Any) -> DeepSpeed:
        check_installed()
        return cls(**arguments)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._groups: list[list[str]] = []  # trainable parameter names per optimizer group, in DeepSpeed's order
        self._fp16 = False
        self._partitioned: Any = None  # DeepSpeed's ZeRO optimizer, around the torch one setup returns

    def precision_plan(self, precision: Precision, device: torch.device) -> DeepSpeedPrecision:
        # bf16-true (parameters stored in bf16) is refused with the settings: composes_with has no bf16_true.
        if not precision.needs_grad_scaler:
            return DeepSpeedPrecision(precision, precision.compute_dtype)
        if device.type != "cuda":
            raise UsageError("DeepSpeed's fp16 runs on GPUs only; use precision bf16-mixed or 32 on CPU.")
        return DeepSpeedPrecision(precision, section={"fp16": {"enabled": True, "auto_cast": True}})

    def updates(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
        return self._partitioned is not None and optimizer is self._partitioned.optimizer

    def check_runnable(self, device: torch.device, plan: DeepSpeedPrecision) -> None:
        self.config(plan)  # the user's config file, read and checked

    def config(self, plan: DeepSpeedPrecision) -> dict[str, Any]:
        """The DeepSpeed config: the user's file, if any, with the Engine's settings, the flags and `plan` applied."""
        options = (self.zero_stage, self.offload_optimizer, self.offload_param, self.max_grad_norm)
        return {**completed_config(self.deepspeed_config, *options), **plan.section}

    def build_context(self, env: DistEnv, plan: PrecisionPlan) -> contextlib.AbstractContextManager[None]:
        """ZeRO-3: deepspeed.zero.Init, which partitions each layer's parameters as soon as the layer is built, so
        no rank holds the whole model; stages 1 and 2 keep whole weights on every rank, so a plain build is all.

        The config is the one setup hands deepspeed.initialize, so both agree on the dtype (fp16 weights under
        fp16-mixed; fp32 otherwise, as the Engine's bf16-mixed is autocast) and on where partitions live.
        """
        deepspeed = import_deepspeed(env)
        config = self.config(plan)
        if config["zero_optimization"]["stage"] != 3:
            return contextlib.nullcontext()
        init = _trimming_init(deepspeed) if env.device.type == "cpu" else deepspeed.zero.Init
        return init(config_dict_or_path=config)

    @property
    def stage(self) -> int:
        return self._config["zero_optimization"]["stage"]

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv, plan: DeepSpeedPrecision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        deepspeed = import_deepspeed(env)
        self._config = self.config(plan)
        if optimizer is not None and optimizer.state:
            raise UsageError("deepspeed must partition a fresh optimizer; call engine.setup before the first step.")
        if optimizer is None and "optimizer" not in self._config:
            raise UsageError(
                "Strategy deepspeed trains only: pass the optimizer to engine.setup, or set one in the config."
            )
        if optimizer is not None and "optimizer" in self._config:
            raise UsageError(
                "Both engine.setup and the DeepSpeed config give an optimizer; drop the config's 'optimizer' section."
            )
        self._fp16 = "fp16" in plan.section
        names = {id(p): name for name, p in model.named_parameters()}
        if optimizer is not None:
            self._groups = [
                [names[id(p)] for p in group["params"] if p.requires_grad] for group in optimizer.param_groups
            ]
        else:
            self._groups = [[name for name, p in model.named_parameters() if p.requires_grad]]
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            # Built under zero.Init (init_module): initialize then leaves the module where it is, trusting zero.Init
            # to have placed it, but buffers from factories zero.Init does not wrap (torch.rand, linspace) would stay
            # on the CPU; a plain model's buffers go to the device with it.
            for buffer in model.buffers():
                buffer.data = buffer.data.to(env.device)
        engine, self._partitioned, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self._config, dist_init_required=False
        )
        # DeepSpeed's wrapper is no torch Optimizer, so schedulers refuse it; the torch optimizer inside it (now
        # over flat partitions) is one, and its learning rates are the ones DeepSpeed steps with.
        return engine, self._partitioned.optimizer

    # The boundary is set on every backward: ZeRO-1 reduces only on it, ZeRO-2/3 reduce-scatter every
    # micro-step by design (their gradients are partitioned), so there is nothing to skip here.
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor, syncs: bool) -> None:
        model.set_gradient_accumulation_boundary(syncs)
        # The Engine has already weighted the loss for accumulation.
        model.backward(loss, scale_wrt_gas=False)

    def optimizer_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        count: float | None,
        max_grad_norm: float | None,
    ) -> StepOutcome:
        if count is not None:
            if self._fp16:
                raise UsageError(
                    "engine.backward(count=) cannot divide DeepSpeed's fp16 gradients by the token count; "
                    "use precision bf16-mixed or 32."
                )
            # DeepSpeed divides the reduced, partitioned gradients by its loss scale (1 outside fp16) in step().
            self._partitioned.loss_scale = max(count, 1.0)
        try:
            model.step()
        finally:
            if count is not None:
                self._partitioned.loss_scale = 1.0
        norm = float(model.get_global_grad_norm()) if max_grad_norm is not None else None
        return StepOutcome(norm, model.was_step_applied())

    def total_grad_norm(self, parameters: Any) -> torch.Tensor:
        raise UsageError("DeepSpeed clips gradients itself; set max_grad_norm on the Engine instead.")

    # Checkpoints hold every trainable parameter and its optimizer states whole, keyed by name, as the other
    # strategies' do: DCP then loads them at any world size, into any strategy, and `multigpu export` reads them.
    # Assembling a whole tensor is a collective, so every rank walks the parameters in the same order; one tensor
    # at a time is assembled, moved to the CPU and kept by one rank only (its owner, round robin), so no rank ever
    # holds more than its share of the whole states (4 bytes per parameter, and 8 more for Adam) plus one tensor.
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_fp32_param

        module, frozen = model.module, frozen_names(model.module)
        state = {}
        trainable = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if n not in frozen]
        for index, (name, param) in enumerate(trainable):
            full = safe_get_full_fp32_param(param)
            if _owns(index):
                state[name] = (full if full is not None else param).detach().to("cpu", copy=True)
        for name, buffer in _persistent_buffers(module):
            state[name] = buffer
        return state

    def model_state_to_load(self, model: nn.Module) -> dict[str, Any]:
        module, frozen = model.module, frozen_names(model.module)
        state = {
            name: torch.empty(_full_shape(param), dtype=torch.float32)
            for name, param in module.named_parameters(remove_duplicate=False)
            if name not in frozen
        }
        return {**state, **dict(_persistent_buffers(module))}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        module = model.module
        params = dict(module.named_parameters(remove_duplicate=False))
        for name, value in state.items():
            if name not in params:
                dict(_persistent_buffers(module))[name].copy_(value)
                continue
            param = params[name]
            safe_set_full_fp32_param(param, value.to(param.device))  # the optimizer's fp32 master copy
            # ...and the weights forward uses; under ZeRO-3 they are partitioned, so gather, write, re-partition.
            gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0) if self.stage == 3 else None
            with gathered or contextlib.nullcontext():
                param.data.copy_(value)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_optimizer_state

        base = _initialised(self._partitioned)
        keys, step = _state_layout(base)
        params = dict(model.module.named_parameters())
        state = {}
        for index, name in enumerate(name for names in self._groups for name in names):
            entry = {key: safe_get_full_optimizer_state(params[name], key) for key in keys}
            if _owns(index):
                entry = {key: value.detach().to("cpu", copy=True) for key, value in entry.items()}
                state[name] = {**entry, "step": step.clone()} if step is not None else entry
        return {"state": state, "param_groups": self._param_groups(base)}

    def optimizer_state_to_load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        base = _initialised(self._partitioned)
        keys, step = _state_layout(base)
        params = dict(model.module.named_parameters())
        state = {}
        for name in (name for names in self._groups for name in names):
            entry = {key: torch.empty(_full_shape(params[name]), dtype=torch.float32) for key in keys}
            state[name] = {**entry, "step": torch.zeros_like(step)} if step is not None else entry
        return {"state": state, "param_groups": self._param_groups(base)}

    def _param_groups(self, base: torch.optim.Optimizer) -> list[dict[str, Any]]:
        return [
            {**{key: value for key, value in group.items() if key != "params"}, "params": names}
            for group, names in zip(base.param_groups, self._groups, strict=True)
        ]

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        base = _initialised(self._partitioned)
        keys, _ = _state_layout(base)
        params = dict(model.module.named_parameters())
        for name, entry in state["state"].items():
            for key in keys:
                safe_set_full_optimizer_state(params[name], entry[key].to(params[name].device), key)
        steps = [entry["step"] for entry in state["state"].values() if "step" in entry]
        for flat_state in base.state.values():
            if steps and "step" in flat_state:
                flat_state["step"] = steps[0].clone().to(flat_state["step"])
        for group, loaded in zip(base.param_groups, state["param_groups"], strict=True):
            group.update({key: value for key, value in loaded.items() if key != "params"})

    def full_state_dict(self, model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module, frozen, main = model.module, frozen_names(model.module), dist.get_rank() == 0
        state = {}
        for name, param in module.named_parameters():
            if trainable_only and name in frozen:
                continue
            full = safe_get_full_fp32_param(param) if name not in frozen else None
            if full is not None:
                if main:
                    state[name] = full.detach().to("cpu", copy=True)
                continue
            # Frozen, or trained outside the optimizer: the weights forward uses, gathered under ZeRO-3.
            with deepspeed.zero.GatheredParameters([param]) if self.stage == 3 else contextlib.nullcontext():
                if main:
                    state[name] = param.detach().to("cpu", copy=True)
        if main:
            state.update({name: buffer.detach().to("cpu", copy=True) for name, buffer in _persistent_buffers(module)})
        return state


@functools.cache
def _trimming_init(deepspeed: Any) -> type:
    """zero.Init for a build on the CPU: after each module's parameters are partitioned, the whole ones just freed
    go back to the system (see give_back_freed_memory), or the heap would keep a hole per layer."""

    class TrimmingInit(deepspeed.zero.Init):
        def _post_init_method(self, module: nn.Module) -> None:
            super()._post_init_method(module)
            give_back_freed_memory()

    return TrimmingInit


def check_installed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise UsageError(f"Strategy deepspeed needs DeepSpeed, which is not installed; run `{INSTALL}`.")


def import_deepspeed(env: DistEnv) -> Any:
    """DeepSpeed, told which accelerator to use; one sentence on how to install it if it is missing.

    DeepSpeed reads who it is from torchrun's variables (its engine fails without LOCAL_RANK), which srun, mpirun
    and a lone `python script.py` do not set: they are filled in from what DistEnv read from the launcher.
    """
    wanted = "cuda" if env.device.type == "cuda" else "cpu"
    chosen = os.environ.setdefault("DS_ACCELERATOR", wanted)
    if chosen != wanted:
        raise UsageError(f"DS_ACCELERATOR={chosen} but this run is on {wanted}; unset DS_ACCELERATOR.")
    for name, value in (("RANK", env.rank), ("LOCAL_RANK", env.local_rank), ("WORLD_SIZE", env.world_size)):
        os.environ.setdefault(name, str(value))
    check_installed()
    # DeepSpeed still calls a torch collective that torch has renamed; the notice is for DeepSpeed, not our users.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning)
    import deepspeed

    if wanted == "cpu":
        # Its CPU accelerator would compile a shared-memory all-reduce with g++ as the process group starts (~30 s
        # the first time in each environment); only DeepSpeed's inference engine calls it, never training.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _owns(index: int) -> bool:
    """Whether this rank keeps the `index`-th whole tensor of a checkpoint (round robin over the ranks)."""
    return index % dist.get_world_size() == dist.get_rank()


def _full_shape(param: torch.Tensor) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)  # ZeRO-3 leaves an empty tensor and keeps the shape aside


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = []
    for owner_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:
                found.append((f"{owner_name}.{name}" if owner_name else name, buffer))
    return found


def _initialised(partitioned: Any) -> torch.optim.Optimizer:
    """DeepSpeed's inner torch optimizer, with its states created (torch creates them at the first step).

    A step at learning rate 0 with zero gradients creates them without moving any weight, the way
    torch.distributed.checkpoint prepares a fresh optimizer for loading.
    """
    base = partitioned.optimizer
    if base.state:
        return base
    flat = [p for group in base.param_groups for p in group["params"]]
    rates = [group["lr"] for group in base.param_groups]
    for param in flat:
        param.grad = torch.zeros_like(param)
    for group in base.param_groups:
        group["lr"] = 0.0
    base.step()
    for group, rate in zip(base.param_groups, rates, strict=True):
        group["lr"] = rate
    for param in flat:
        param.grad = None
        if "step" in base.state[param]:
            base.state[param]["step"].zero_()
    if hasattr(partitioned, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link per-parameter views lazily
        partitioned._lazy_init_hp_params_optimizer_state()
    return base


def _state_layout(base: torch.optim.Optimizer) -> tuple[list[str], torch.Tensor | None]:
    """The per-element state keys (e.g. exp_avg) and the step count, which DeepSpeed keeps per flat group."""
    flat_state = next(iter(base.state.values()))
    keys = [key for key, value in flat_state.items() if torch.is_tensor(value) and value.dim() > 0]
    step = flat_state.get("step")
    return keys, (torch.as_tensor(step, dtype=torch.float32) if step is not None else None)
