"""What a model is made of: its repeated blocks, the units zero3 shards and gathers and the planner sizes."""

from __future__ import annotations

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def default_units(model: nn.Module) -> list[nn.Module]:
    """One unit per block: the items of every ModuleList or ModuleDict that are not containers themselves
    (transformer layers, however deeply nested), else each top-level child that has parameters.

    A unit is all-gathered as a whole, so its size sets the temporary memory and the overlap granularity.
    """
    blocks = [
        block
        for module in model.modules()
        if isinstance(module, _CONTAINERS)
        for block in (module.values() if isinstance(module, nn.ModuleDict) else module)
        if not isinstance(block, _CONTAINERS)
    ]
    if blocks:
        return blocks
    return [child for child in model.children() if any(True for _ in child.parameters())]
