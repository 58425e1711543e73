"""A checkpoint's optimizer states loaded into another kind of AdamW: float32 states (adamw), bfloat16 ones
(adamw-bf16), or states quantised in blocks (adamw-8bit, adamw-4bit). Each holds the same two moments per
parameter in its own format, so each takes the others' states: the values the saved optimizer held, which the new
one holds exactly where its format has them (any of them in float32), and otherwise rounds as it rounds its own.

The Engine names each optimizer's kind in the checkpoints it writes (`optimizer_kind`) and, loading one into an
optimizer of another kind, hands checkpoint.load a `Conversion`: the moments are read in the dtype they were saved
in, turned into the values the saved optimizer held (a quantised state is saved as the values it was quantised
from, low_bit.saved_values), and the new optimizer's own load then casts or quantises them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multigpu.config.optimizer import LOW_BIT
from multigpu.core.errors import UsageError

#: The optimizers whose states convert into one another.
ADAMW_KINDS = ("adamw", *LOW_BIT)
QUANTISED = ("adamw-8bit", "adamw-4bit")
#: The moments among an AdamW's states, and whether each is signed (the quantised maps differ).
MOMENTS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}
_TORCH_KINDS: dict[type, str] = {torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """The optimizer setting that builds `optimizer` (for ZeRO-1's wrapper, the optimizer it wraps), or None for
    an optimizer of a script's own."""
    inner = getattr(optimizer, "optim", optimizer)
    return getattr(type(inner), "KIND", None) or _TORCH_KINDS.get(type(inner))


def optimizer_kinds(state: dict[str, Any]) -> dict[str, str | None]:
    """The kind of each optimizer in a checkpoint's `state`, by its key (what a checkpoint keeps of them)."""
    return {key: optimizer_kind(value) for key, value in state.items() if isinstance(value, torch.optim.Optimizer)}


def conversions(path: Path, state: dict[str, Any], saved: dict[str, str | None]) -> dict[str, Conversion]:
    """The optimizers in `state` that load the states of another kind of optimizer from the checkpoint at `path`
    (`saved`: its optimizer_kinds), by key; refuses those that cannot take them."""
    found = {}
    for key, value in state.items():
        source = saved.get(key)
        target = optimizer_kind(value) if isinstance(value, torch.optim.Optimizer) else None
        if source is not None and target is not None and source != target:
            check_convertible(path, source, target)
            found[key] = Conversion(source, target)
    return found


def check_convertible(path: Path, source: str, target: str) -> None:
    """Refuses to load the states of a `source` optimizer into a `target` one that holds other states (every rank
    refuses alike)."""
    if source == target or (source in ADAMW_KINDS and target in ADAMW_KINDS):
        return
    others = ", or another AdamW" if source in ADAMW_KINDS else ""
    refusal = UsageError(
        f"The checkpoint {path} holds the states of optimizer {source}, which optimizer {target} does not take; "
        f"load it with optimizer {source}{others}, or start anew."
    )
    refusal.on_every_rank = _grouped()
    raise refusal


@dataclass
class Conversion:
    """checkpoint.load's conversion of a `source` optimizer's states for a `target` one (checkpoint.Conversion)."""

    source: str
    target: str
    held: dict[tuple[str, str], torch.dtype] = field(default_factory=dict)  # the dtype `target` holds each moment in

    def prepare(self, to_load: dict[str, Any], saved_dtype: Callable[[str], torch.dtype | None]) -> None:
        self.held = read_as_saved(to_load["state"], lambda name, moment: saved_dtype(f"state.{name}.{moment}"))

    def apply(self, loaded: dict[str, Any]) -> str:
        """The line that says how exactly `target` holds the states, the same on every rank."""
        exact = convert(loaded["state"], self.source, self.target, self.held)
        return conversion_line(self.source, self.target, _on_every_rank(exact))


def read_as_saved(
    states: dict[str, dict[str, Any]], saved_dtype: Callable[[str, str], torch.dtype | None]
) -> dict[tuple[str, str], torch.dtype]:
    """Each moment of `states` (an optimizer's states to load, by parameter name) replaced by one of the dtype
    `saved_dtype(name, moment)` says it was saved in, so that the checkpoint's values are read unrounded; returns
    the dtype the optimizer holds each moment in."""
    held = {}
    for name, entry in states.items():
        for moment in MOMENTS.keys() & entry.keys():
            held[name, moment] = entry[moment].dtype
            dtype = saved_dtype(name, moment)
            if dtype is not None and dtype != entry[moment].dtype:
                entry[moment] = entry[moment].to(dtype)
    return held


def convert(states: dict[str, dict[str, Any]], source: str, target: str, held: dict[tuple[str, str], Any]) -> bool:
    """The moments of `states`, read from a checkpoint of optimizer `source` (read_as_saved), turned into the values
    that optimizer held, for optimizer `target` to load; whether `target` holds each of them exactly on this rank
    (`held`: the dtypes it holds them in)."""
    exact = True
    for name, entry in states.items():
        for moment in MOMENTS.keys() & entry.keys():
            signed, values = MOMENTS[moment], entry[moment]
            entry[moment] = values = _held(source, values, signed, values.dtype)
            kept = _held(target, values, signed, held[name, moment])
            exact = exact and torch.equal(local(kept).float(), local(values).float())
    return exact


def conversion_line(source: str, target: str, exact: bool) -> str:
    """What a load that converted a `source` optimizer's states for a `target` one says."""
    if exact:
        how = "exact"
    elif target in QUANTISED:
        bits = target.removeprefix("adamw-").removesuffix("bit")
        how = f"quantised to {bits} bits, as each of its steps quantises them"
    else:
        how = "rounded to the nearest bfloat16"
    return f"resume: optimizer states converted from {source} to {target} ({how})"


def _held(kind: str, values: torch.Tensor, signed: bool, dtype: torch.dtype) -> torch.Tensor:
    """What an optimizer `kind` holds of a state's `values` (a tensor, or a DTensor's shards), where it keeps them
    in `dtype`: quantised in its blocks and read back as float32, or cast."""
    if kind not in QUANTISED:
        return values.to(dtype)
    from multigpu.optimizers.low_bit import quantised_values, rewrapped

    return rewrapped(values, quantised_values(kind, local(values), values.numel(), signed))


def _on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank (a collective where processes are grouped)."""
    if not _grouped():
        return flag
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local tensor, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
