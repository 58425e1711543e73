"""What the planner reads of an nn.Module: its parameters, its FSDP units, a mixture's experts, and (given one
sample) the activations a traced forward keeps. torch is imported only here, and only when a module is given."""

from __future__ import annotations

from typing import Any

from multigpu.planner.shapes import ModelShape


def saved_activation_bytes(module: Any, sample: Any) -> float:
    """Bytes autograd keeps for backward in one forward of `module` on `sample` (parameters excluded)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params:
            seen[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(sample)
    return float(sum(seen.values()))


def expert_modules(module: Any) -> list[tuple[Any, int]]:
    """A mixture's expert containers and how many experts each holds: the submodules named `experts`, as Hugging
    Face's MoE blocks (3-D weights, `num_experts`) and most hand-written ones (an nn.ModuleList) name them."""
    from torch import nn

    found = []
    for name, child in module.named_modules():
        count = getattr(child, "num_experts", None) or (len(child) if isinstance(child, nn.ModuleList) else 0)
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(count, int) and count > 0:
            found.append((child, count))
    return found


def from_module(module: Any, sample_input: Any = None) -> ModelShape:
    """Counts an nn.Module's parameters; its FSDP units give the largest gathered unit. With `sample_input` (one
    sample, batch dimension 1) a traced forward measures the activations per sample. A mixture's experts
    (expert_modules) are counted apart, their linears outside LoRA's targets and QLoRA's quantised linears."""
    from torch import nn

    from multigpu.transforms.modules import default_units

    units = default_units(module) or [module]
    experts = expert_modules(module)
    inside = {id(m) for container, _ in experts for m in container.modules()}
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    return ModelShape(
        params=sum(p.numel() for p in module.parameters()),
        name=type(module).__name__,
        largest_unit=max(sum(p.numel() for p in unit.parameters()) for unit in units),
        linear_params=sum(m.weight.numel() for m in linears),
        lora_shapes=tuple((m.in_features, m.out_features) for m in linears),
        trainable=sum(p.numel() for p in module.parameters() if p.requires_grad),
        activation_bytes_per_sample=0.0 if sample_input is None else saved_activation_bytes(module, sample_input),
        largest_tensor=max((p.numel() for p in module.parameters()), default=0),
        expert_params=sum(p.numel() for container, _ in experts for p in container.parameters()),
        experts=min((count for _, count in experts), default=0),
    )
