"""What a model is made of: its repeated blocks (the units zero3 shards and gathers and the planner sizes), and how
a model built on the meta device gets its storage and its initial values."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from multigpu.core.errors import UsageError

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


def on_meta(model: nn.Module) -> bool:
    """Whether `model` was built on the meta device (engine.init_module): shapes without storage."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def post_order(model: nn.Module) -> list[nn.Module]:
    """Every module, children before their parent, siblings in registration order: the order in which a plain
    build runs their initialisation (a child's __init__ ends before its parent's does)."""
    ordered: list[nn.Module] = []
    for child in model.children():
        ordered += post_order(child)
    return [*ordered, model]


def materialize(
    model: nn.Module, device: torch.device | str, on_done: Callable[[nn.Module], None] | None = None
) -> None:
    """Gives a meta-built `model` storage on `device` and initialises it as a plain build would have: each
    module's `reset_parameters()`, children before parents, from the random stream as it stands (the caller puts
    it where the build began). `on_done(module)` runs once each module and everything under it is initialised,
    so a caller can shard a unit before the next one takes memory."""
    seen: dict[int, str] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if id(tensor) in seen:  # one module's to_empty would leave the other holding the old meta tensor
            raise UsageError(
                f"{seen[id(tensor)]} and {name} share one parameter, which engine.init_module() cannot rebuild "
                "shared yet; build this model outside init_module."
            )
        seen[id(tensor)] = name
    for module in post_order(model):
        if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            # torch.nn's layers call this at the end of __init__; MultiheadAttention names it with an underscore.
            reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
            if reset is None:
                raise UsageError(
                    f"{type(module).__name__} holds parameters or buffers but has no reset_parameters(), so a "
                    "model built under engine.init_module() cannot initialise it; give it a reset_parameters() "
                    "that initialises its own parameters and buffers, or build the model outside init_module."
                )
            module.to_empty(device=device, recurse=False)
            reset()
        if on_done is not None:
            on_done(module)


def repoint(optimizer: torch.optim.Optimizer | None, names: dict[int, str], model: nn.Module) -> None:
    """Points `optimizer` at `model`'s current parameters, found by the names `names` gives the old ones' ids:
    materialising and sharding replace Parameter objects, and an optimizer built before holds the old ones."""
    if optimizer is None:
        return
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] for p in group["params"]]


def give_back_freed_memory() -> None:
    """Returns the C heap's free pages to the system (glibc; elsewhere nothing happens). glibc keeps what a freed
    unit held for later and serves the next unit's storage from fresh pages around it, so a unit-by-unit build's
    resident memory would climb by a unit's worth per unit; after this, it holds what is alive and one unit."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: musl, macOS
        return None


_malloc_trim = _find_malloc_trim()
