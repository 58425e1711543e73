"""What a model is made of: its repeated blocks (the units zero3 shards and gathers and the planner sizes), and how
a model built on the meta device gets its storage and its initial values."""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from multigpu.core.errors import UsageError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def default_units(model: nn.Module) -> list[nn.Module]:
    """One unit per block: the items of every ModuleList or ModuleDict that are not containers themselves
    (transformer layers, however deeply nested), else each top-level child; only blocks that hold parameters.

    A unit is all-gathered as a whole, so its size sets the temporary memory and the overlap granularity. Two rules
    keep a unit from breaking the model:
    - An adapter (peft's lora_A, lora_B, lora_dropout dicts inside a tuner layer) is never a unit: its base layer's
      block holds it. As units of their own, an Identity dropout returned a view of its gathered input (FSDP warns of
      wrong gradients), and a wrapper around a parameter (LoRA on experts) reads its adapters' weights without calling
      them, which would leave them sharded.
    - A block holding a parameter that a module outside it shares (nanoGPT's `transformer.wte`, tied to `lm_head`)
      is no unit: FSDP manages a parameter in one unit only, so the tie goes to the unit (or root) holding both.
    """
    adapters = {id(d) for m in model.modules() if getattr(m, "adapter_layer_names", ()) for d in m.children()}
    blocks = [
        block
        for module in model.modules()
        if isinstance(module, _CONTAINERS) and id(module) not in adapters
        for block in (module.values() if isinstance(module, nn.ModuleDict) else module)
        if not isinstance(block, _CONTAINERS)
    ] or list(model.children())
    owners = parameter_owners(model)
    return [block for block in blocks if _holds_parameters(block) and not splits_ties(block, owners)]


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def parameter_owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Each parameter shared by several modules (tied weights), by id: the modules that register it."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    return {pid: modules for pid, modules in owners.items() if len(modules) > 1}


def splits_ties(unit: nn.Module, owners: dict[int, list[nn.Module]]) -> bool:
    """Whether `unit` holds a tied parameter that a module outside it also holds."""
    inside = {id(module) for module in unit.modules()}
    return any(
        any(id(owner) not in inside for owner in owners[id(param)])
        for param in unit.parameters()
        if id(param) in owners
    )


def check_ties(model: nn.Module, units: list[nn.Module]) -> None:
    """Refuses units (a unit selector's own) that would put one side of a tied parameter in a unit without the other."""
    owners = parameter_owners(model)
    names = {id(module): name for name, module in model.named_modules()}
    for unit in units:
        if splits_ties(unit, owners):
            raise UsageError(
                f"The unit {names.get(id(unit), type(unit).__name__)!r} holds a parameter tied to a module outside it "
                "(shared weights, such as embeddings tied to the output head), which FSDP cannot shard in two units; "
                "leave that module out of your units so the tie stays in the unit or root that holds both."
            )


def stop_caching(model: nn.Module) -> None:
    """A Hugging Face model stops filling its key/value cache in forward, which training never reads: a recomputed
    block would add its keys to the cache a second time (and selective checkpointing, meeting other ops than the
    forward ran, raises), and a compiled block would compile once per layer, its guards holding each layer's cache
    entry. transformers turns the cache off for its own gradient checkpointing too."""
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False


def outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """Those of `blocks` that no other of them holds: a transformer's layers rather than the adapters inside them."""
    inner = {id(module) for block in blocks for module in block.modules() if module is not block}
    return [block for block in blocks if id(block) not in inner]


def on_meta(model: nn.Module) -> bool:
    """Whether `model` was built on the meta device (engine.init_module): parameters without storage."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Builds every parameter registered inside it on the meta device, and buffers as usual.

    Buffers stay real because a module computes some of them in __init__ with no way to redo it (rotary
    frequencies): they are small, and every rank holds them whole anyway. A parameter's initialiser then runs on
    the meta device and draws nothing from the random stream, so materialize() can draw exactly what it would have.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and type(param) is nn.Parameter and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def post_order(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Every module with its name, children before their parent, siblings in registration order: the order in which
    a plain build runs their initialisation (a child's __init__ ends before its parent's does)."""
    ordered: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        ordered += post_order(child, f"{prefix}{name}.")
    return [*ordered, (prefix.rstrip("."), model)]


#: Where pretrained values come from: the tensor stored under a parameter's or buffer's full name, or None.
Reader = Callable[[str], "torch.Tensor | None"]


def materialize(
    model: nn.Module,
    device: torch.device | str,
    on_done: Callable[[nn.Module], None] | None = None,
    read: Reader | None = None,
) -> list[str]:
    """Gives a meta-built `model` storage on `device` and its values: `read(name)` where it has one, else what a
    plain build would have drawn: each module's `reset_parameters()`, children before parents, from the random
    stream as it stands (the caller puts it where the build began). `on_done(module)` runs once each module and
    everything under it has its values, so a caller can shard or send a unit before the next one takes memory.
    Returns the names of the tensors that were initialised rather than read."""
    counts: dict[int, int] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
        if counts[id(tensor)] > 1 and read is None:  # a reset would run once per owner, on two copies
            raise UsageError(
                f"{name} shares its parameter with another module, which engine.init_module() cannot initialise "
                "shared; build this model outside init_module, or give its values with engine.load_pretrained()."
            )
    made: dict[int, torch.Tensor] = {}  # tied meta tensors already given storage, so that their owners share it
    initialised: list[str] = []
    for prefix, module in post_order(model):
        values: dict[str, torch.Tensor] = {}
        needs_reset = False
        for slots, name, tensor in [(d, n, t) for d in (module._parameters, module._buffers) for n, t in d.items()]:
            if tensor is None:
                continue
            if id(tensor) in made:  # tied to a tensor an earlier module has made already
                slots[name] = made[id(tensor)]
                continue
            full = f"{prefix}.{name}" if prefix else name
            value = read(full) if read is not None else None
            if not tensor.is_meta:  # a buffer built for real (parameters_on_meta): the checkpoint's, if it has one
                if value is not None:
                    values[name] = value
                continue
            if value is None:
                initialised.append(full)
                needs_reset = True
            else:
                values[name] = value
            slots[name] = _like(tensor, torch.empty_like(tensor, device=device))
            if counts.get(id(tensor), 0) > 1:
                made[id(tensor)] = slots[name]
        if needs_reset:
            _reset(module)
        with torch.no_grad():
            for name, value in values.items():
                getattr(module, name).copy_(value)
        if on_done is not None:
            on_done(module)
    return initialised


def _like(old: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    """`storage` as what `old` was: a Parameter (keeping requires_grad) or a plain buffer tensor."""
    return nn.Parameter(storage, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else storage


def _reset(module: nn.Module) -> None:
    # torch.nn's layers call this at the end of __init__; MultiheadAttention names it with an underscore.
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None:
        raise UsageError(
            f"{type(module).__name__} holds parameters or buffers but has no reset_parameters(), so a model built "
            "under engine.init_module() cannot initialise it; give it a reset_parameters() that initialises its own "
            "parameters and buffers, load its values with engine.load_pretrained(), or build it outside init_module."
        )
    reset()


def release(module: nn.Module) -> None:
    """Puts `module`'s parameters and buffers back on the meta device, freeing their storage (its values were sent)."""
    for slots in (m for sub in module.modules() for m in (sub._parameters, sub._buffers)):
        for name, tensor in slots.items():
            if tensor is not None and not tensor.is_meta:
                slots[name] = _like(tensor, tensor.to("meta"))


def repoint(optimizer: torch.optim.Optimizer | None, names: dict[int, str], model: nn.Module) -> None:
    """Points `optimizer` at `model`'s current parameters, found by the names `names` gives the old ones' ids:
    materialising and sharding replace Parameter objects, and an optimizer built before holds the old ones."""
    if optimizer is None:
        return
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] for p in group["params"]]


@contextlib.contextmanager
def repointing(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> Iterator[None]:
    """Around a step that replaces `model`'s Parameter objects in place (tp's split, ep's spread): `optimizer` then
    points at the new ones (repoint)."""
    names = {id(p): name for name, p in model.named_parameters()}
    yield
    repoint(optimizer, names, model)


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


@dataclass
class MetaValues:
    """Where the values of a model built on the meta device come from, on the rank that makes them: a copy of the
    model as built (taken before setup changes it: casts, wrappers) and the pretrained checkpoint, if any.
    Ranks that receive their shards instead hold `built=None`."""

    built: nn.Module | None
    read: Reader | None = None
    initialised: list[str] = field(default_factory=list)

    def make(self, on_done: Callable[[nn.Module], None]) -> None:
        """Builds the copy's values on the CPU a module at a time, calling `on_done` after each (see materialize)."""
        assert self.built is not None, "only the rank that makes the values builds them"
        self.initialised = materialize(self.built, "cpu", on_done, self.read)


def name_pattern(pattern: str) -> re.Pattern[str]:
    """A module-name pattern as plans write them: `*` stands for one name in the dotted path."""
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))


def call_with(model: nn.Module, inputs: Any) -> Any:
    """model(inputs): a dict as keywords, a tuple as positional arguments, anything else as the one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)
