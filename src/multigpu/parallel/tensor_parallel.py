"""Tensor parallelism: the planned layers' weight matrices split across the processes of the mesh's "tp" dimension.

The plan is the model's: Hugging Face models carry one (`model.tp_plan`, e.g. Llama's q/k/v/gate/up projections
split by output columns, o/down by input rows, the embedding by vocabulary rows); a model of one's own declares a
`tp_plan` attribute the same way, module-name patterns ("blocks.*.up", `*` one name in the path) -> a style
(tp_styles.py). The `tp` strategy is tensor parallelism alone (every process one slice of every planned layer);
zero2, zero3 and hsdp compose with it through `tp_size` (their data-parallel dimensions outside, tp inside a node;
hsdp with one process per shard is ddp's whole replicas).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    parallelize_module,
)

from multigpu.config.layout import TensorParallelOptions, check_tp_heads
from multigpu.core.errors import UsageError, require
from multigpu.parallel.experts import without_experts
from multigpu.parallel.tp_styles import PLAN_SEQUENCE_STYLES, SEQUENCE_STYLES, STYLES
from multigpu.transforms.modules import name_pattern


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan (its `tp_plan`), or one sentence saying how to give one."""
    plan = without_experts(model, getattr(model, "tp_plan", None) or {})
    if not plan:
        raise UsageError(
            f"{type(model).__name__} has no tensor-parallel plan; give the model a tp_plan attribute mapping "
            "module-name patterns to colwise/rowwise (e.g. {'blocks.*.up': 'colwise', 'blocks.*.down': 'rowwise'}), "
            "or drop tp_size."
        )
    unknown = sorted({style for style in plan.values() if style not in PLAN_SEQUENCE_STYLES})
    if unknown:
        raise UsageError(
            f"The tensor-parallel plan of {type(model).__name__} names style(s) {', '.join(map(str, unknown))}, which "
            f"multigpu does not apply; use {', '.join(PLAN_SEQUENCE_STYLES)}."
        )
    return dict(plan)


def _plan_of(module: nn.Module) -> dict[str, str]:
    return getattr(module, "tp_plan", None) or {}


def planned_modules(model: nn.Module, plan: dict[str, str], sequence: str | None = None) -> dict[str, str]:
    """Module name -> style for every module a pattern of `plan` matches; a pattern that matches none is refused.

    The patterns are relative to the module that declares the plan: a wrapper that passes the inner model's
    attributes through (peft's PeftModel) puts the inner model's name in front of them. A LoRA layer in the place of
    a split layer gets its adapter split to match (lora_adapter_styles)."""
    modules = dict(model.named_modules())
    # The plan may be the declared one less its mixture-of-experts entries (experts.without_experts).
    owner = max((name for name, module in modules.items() if plan.items() <= dict(_plan_of(module)).items()), key=len)
    prefix = f"{owner}." if owner else ""
    found: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = name_pattern(prefix + pattern)
        matched = [name for name in modules if regex.fullmatch(name)]
        if not matched:
            raise UsageError(
                f"The tensor-parallel plan's pattern {pattern!r} matches no module of {type(model).__name__}; "
                "correct the pattern (names as model.named_modules() gives them) or remove it."
            )
        for name in matched:
            found.update(lora_adapter_styles(name, modules[name], style, sequence))
    return found


def lora_adapter_styles(name: str, module: nn.Module, style: str, sequence: str | None = None) -> dict[str, str]:
    """{name: style} for a plain layer; for a LoRA layer (peft: base_layer + lora_A/lora_B), the splits that keep
    its adapter's output in step with the split base layer's. Column split: the base's outputs are sliced, so are
    lora_B's (lora_A, whole, sees the whole input). Row split: the base takes a slice of the input, so does lora_A,
    whose outputs are then summed whole for lora_B. Gathered outputs are whole, so the adapter stays whole."""
    if not hasattr(module, "base_layer") or not isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
        return {name: style}
    split = {"colwise": "lora_B", "rowwise": "lora_A", "colwise_gather_output": None}
    if style not in split:
        raise UsageError(
            f"{name} is a LoRA layer and its plan says {style}; LoRA adapters are split along colwise, rowwise and "
            "colwise_gather_output layers only: leave the adapter off this layer or the layer whole."
        )
    styles = {f"{name}.base_layer": style}
    if split[style] is not None:
        adapters = getattr(module, split[style])
        styles.update({f"{name}.{split[style]}.{adapter}": style for adapter in adapters})
    # Under sequence parallelism (`sequence`: "decoder" or "plan", as tensor_parallelize) a whole adapter that sees
    # one rank's positions runs on them: lora_B after a row split, lora_A before a column split of a plan's own.
    if sequence and style == "rowwise":
        styles.update({f"{name}.lora_B.{adapter}": "sequence_parallel" for adapter in module.lora_B})
    if sequence == "plan" and style == "colwise":
        styles.update({f"{name}.lora_A.{adapter}": "sequence_parallel" for adapter in module.lora_A})
    return styles


def check_divisible(model: nn.Module, modules: dict[str, str], degree: int) -> None:
    """Refuses a split that does not come out even: the features each style splits, and a Hugging Face model's
    attention heads (each process must get whole heads)."""
    check_tp_heads(getattr(model, "config", None), degree)
    for name, style in modules.items():
        module = model.get_submodule(name)
        if style in ("sequence_parallel", "replicated_with_grad_allreduce"):  # they split nothing
            continue
        if not isinstance(module, nn.Linear | nn.Embedding):
            raise UsageError(
                f"The tensor-parallel plan splits {name}, a {type(module).__name__}; only Linear and Embedding "
                "layers can be split: point the pattern at the layers inside it."
            )
        # A column split cuts the output features (rows of the weight), a row split the input features.
        rows, columns = module.weight.shape
        size = rows if style.startswith("colwise") or isinstance(module, nn.Embedding) else columns
        if size % degree:
            raise UsageError(
                f"tp_size {degree} does not divide the {size} features {name} splits ({style}); choose a tp_size "
                "that divides it."
            )


def tensor_parallelize(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Splits `model`'s planned layers over `mesh` (one dimension) in place: their weights become DTensors sharded
    over it; the other parameters stay whole on every process, where they get the same gradient everywhere. With
    `sequence_parallel`, a Hugging Face decoder's norms and residual stream are split by position as well; a plan
    of one's own that names sequence_parallel modules splits them by its own convention (PLAN_SEQUENCE_STYLES)."""
    given = model_plan(model)
    sequence = "plan" if "sequence_parallel" in given.values() else "decoder" if sequence_parallel else None
    modules = planned_modules(model, given, sequence)
    check_divisible(model, modules, mesh.size())
    styles = {None: STYLES, "decoder": SEQUENCE_STYLES, "plan": PLAN_SEQUENCE_STYLES}[sequence]
    plan = {name: styles[style]() for name, style in modules.items()}
    if sequence == "decoder":
        plan |= decoder_sequence_plan(model)
    ties = tied_places(model)
    parallelize_module(model, mesh, plan)
    # Splitting replaces each Parameter with a new one, so a weight shared by two layers (a head tied to the
    # embeddings) would become two; both are split the same way, so the second name gets the first one's back.
    for (owner, attribute), (source, source_attribute) in ties:
        setattr(owner, attribute, getattr(source, source_attribute))


def decoder_sequence_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Sequence parallelism for a Hugging Face decoder (found by its pipeline plan): the first layer takes its
    positions of the whole embeddings (the mask and rotary positions were made for the whole sequence), each layer's
    norms run on those, and its attention and MLP gather every position first, since they shape their heads by
    their input. Other models are refused in one sentence."""
    from multigpu.parallel.decoder import find_decoder

    found = find_decoder(model)
    if found is None:
        raise UsageError(
            f"sequence_parallel splits a Hugging Face decoder's norms by position, and {type(model).__name__} is not "
            "one (its config has no base_model_pp_plan); drop sequence_parallel."
        )
    prefix, decoder, (_, layer_list, norm) = found
    layers = f"{prefix}{layer_list}"
    plan: dict[str, ParallelStyle] = {
        f"{layers}.0": _ToPositions(),
        f"{prefix}{norm}": SEQUENCE_STYLES["sequence_parallel"](),
    }
    for index, layer in enumerate(getattr(decoder, layer_list)):
        for child_name, child in layer.named_children():
            norm_like = "norm" in type(child).__name__.lower()
            plan[f"{layers}.{index}.{child_name}"] = (
                SEQUENCE_STYLES["sequence_parallel"]() if norm_like else _AllPositions()
            )
    return plan


class _Relayout(ParallelStyle):
    """Changes the placement of a module's hidden states on the way in (the first positional argument, or the
    `hidden_states` keyword) over the tp mesh: `source` -> `target`, handed on as a plain tensor."""

    source: Any
    target: Any

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def relayout(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(self.target, Shard) and tensor.shape[1] % device_mesh.size():
                raise UsageError(
                    f"sequence_parallel splits each sequence over the {device_mesh.size()} tp processes, and this "
                    f"batch's sequences have {tensor.shape[1]} positions; pad each batch to a multiple of "
                    f"{device_mesh.size()} (engine.sequence_multiple) with the padding masked out of attention and "
                    "the loss, or drop sequence_parallel."
                )
            placed = DTensor.from_local(tensor, device_mesh, (self.source,), run_check=False)
            return placed.redistribute(device_mesh, (self.target,)).to_local()

        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (relayout(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": relayout(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class _ToPositions(_Relayout):
    source, target = Replicate(), Shard(1)  # a slice, no communication; its backward gathers


class _AllPositions(_Relayout):
    source, target = Shard(1), Replicate()  # an all-gather; its backward sums and scatters


def tied_places(model: nn.Module) -> list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]]:
    """(module, attribute) pairs that hold a parameter already held under an earlier name, with that first place."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for attribute, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                ties.append(((module, attribute), first[id(param)]))
            else:
                first[id(param)] = (module, attribute)
    return ties


def check_sequence_parallel(strategy: TensorParallelOptions) -> None:
    """Refuses sequence parallelism where the layout has no tensor parallelism to split the sequence over."""
    require(
        (
            not strategy.sequence_parallel or strategy.layout.tp > 1,
            "sequence_parallel splits the sequence over the tp processes, and this run has no tensor parallelism; "
            "add tp_size (or strategy tp), or drop sequence_parallel.",
        )
    )


def start_alike(model: nn.Module, device: torch.device) -> None:
    """Gives every process rank 0's weights and buffers: the split layers take their slices from them, and the
    layers that stay whole must be the same everywhere. A tensor still elsewhere than `device` (a pipeline's model
    before its stages move, zero3's with cpu_offload) travels through it one at a time: NCCL sends GPU memory only."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device == device:
            dist.broadcast(tensor.data, src=0)
        else:
            travelling = tensor.data.to(device)
            dist.broadcast(travelling, src=0)
            tensor.data.copy_(travelling)
