"""Where a model's values come from before engine.setup splits and wraps it: a pretrained checkpoint copied into a
plain build (load_pretrained), or a build on the meta device given a plain build's values, or the checkpoint's."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from multigpu.core.env import DistEnv
from multigpu.core.errors import UsageError
from multigpu.strategies import Strategy
from multigpu.transforms.modules import MetaValues, materialize, on_meta, repoint
from multigpu.transforms.pretrained import SafetensorsCheckpoint

#: What engine.setup knows of a model's build: where the random stream stood when init_module's build began, and the
#: checkpoint load_pretrained gave a model on the meta device.
Build = tuple[torch.Tensor | None, SafetensorsCheckpoint | None]


def check_loadable(model: nn.Module, read: SafetensorsCheckpoint) -> None:
    """Refuses, before any value is read, a model the checkpoint cannot fill: one already partitioned, or one
    whose tensors have other shapes than the stored ones of the same names."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise UsageError(
            "A model built in DeepSpeed's zero.Init is already partitioned; build it under "
            "engine.init_module(meta=True) to load pretrained weights into it."
        )
    shapes = {name: tensor.shape for name, tensor in model.state_dict(keep_vars=True).items()}
    read.check_fits(shapes, "in the model", "load the checkpoint saved from this model, or build the model it fits")


def load_whole(model: nn.Module, read: SafetensorsCheckpoint) -> list[str]:
    """Copies the checkpoint into a model that holds all its weights (check_loadable's), a tensor at a time;
    returns the names it does not hold (left as built)."""
    kept = []
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            value = read(name)
            if value is None:
                kept.append(name)
            else:
                tensor.copy_(value)
    return kept


def meta_values(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    env: DistEnv,
    rng: torch.Tensor | None,
    read: SafetensorsCheckpoint | None,
    say: Callable[[str], None],
) -> MetaValues | None:
    """For a model on the meta device: the random stream goes back to where its build began, so the values it is
    given are a plain build's (or the checkpoint's). A strategy that shards (builds_on_meta) gets them from rank 0
    a unit at a time in its setup; any other gets the whole model here, on the CPU. None: nothing left to make."""
    if not on_meta(model):
        return None
    if optimizer is not None and optimizer.state:
        raise UsageError("A model built under engine.init_module needs a fresh optimizer; call setup before stepping.")
    if rng is not None:
        torch.set_rng_state(rng)
    if strategy.builds_on_meta:
        # Only rank 0 makes the values, from a copy of the model as built (before casts and wrappers).
        return MetaValues(copy.deepcopy(model), read) if env.rank == 0 else MetaValues(None)
    names = {id(p): name for name, p in model.named_parameters()}
    initialised = materialize(model, "cpu", read=read)
    repoint(optimizer, names, model)
    if read is not None:
        say(read.summary(initialised))
    return None
