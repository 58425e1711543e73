"""Settings, each defined once: a dataclass field holds its type (the annotation), default, help text and choices,
and its group's `check` holds its checks.

Groups compose by inheritance: EngineConfig is every group the Engine reads, each defined in the lowest layer that
reads it (the planner's in core, a strategy's own options in its file). A verb that shows settings of another
config under its own defaults or flag names (train's `--multi-gpu` is the Engine's strategy, verify's overrides
default to the script's own) derives them with `derive`: the fields keep their definition, and the derived group's
check builds the source from the values, so the source's checks run. The CLI's flags, config files, `multigpu
config VERB` and docs/cli.md are all made from the fields (config/flags.py, config/config_file.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from multigpu.config.precision import PRECISIONS, Precision
from multigpu.core.errors import UsageError, require

#: What activation_checkpointing may be (models/recompute.py says what each recomputes).
RECOMPUTE_MODES = ("none", "full", "selective", "offload")


def setting(
    default: Any,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    metavar: str | None = None,
    aliases: Iterable[str] = (),
) -> Any:
    """A setting's definition as a dataclass field: its default, its help text and its choices; `aliases` are other
    names its flag and config key also take (the strategy is --strategy on some verbs and --multi-gpu on others)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if metavar is not None:
        metadata["metavar"] = metavar
    if aliases:
        metadata["aliases"] = tuple(aliases)
    return dataclasses.field(default=default, metadata=metadata)


def aliases(field: dataclasses.Field) -> tuple[str, ...]:
    """The other names a setting's flag and config key take."""
    return field.metadata.get("aliases", ())


class Settings:
    """A group of settings (a dataclass): once built, a value outside its setting's choices is refused, then each
    class's own `check` runs, base groups first, so a config made of several groups checks each of them."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            choices, value = field.metadata.get("choices"), getattr(self, field.name)
            if choices is not None and value is not None and value not in choices:
                raise UsageError(f"Unknown {field.name} {value!r}; choose one of {', '.join(map(str, choices))}.")
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("check")
            if check is not None:
                check(self)


class StrategyOptions(Settings):
    """A group of settings that only some strategies take (their constructor arguments): the strategy registry
    refuses a value other than the default for a strategy that does not take it."""


def strategy_option_fields() -> list[tuple[type, dataclasses.Field]]:
    """(group, field) of every strategy option: each StrategyOptions group's fields (EngineConfig is made of them)."""
    return [(group, field) for group in StrategyOptions.__subclasses__() for field in dataclasses.fields(group)]


class Derived(Settings):
    """Settings made by `derive`: each field maps to a source config's field of its own name or of a renamed one."""

    #: (source, {field here: field of the source}) for each source.
    sources: ClassVar[tuple[tuple[type, dict[str, str]], ...]] = ()
    #: Whether a field at None stands for "not set here" (the source's own default, or a script's own value).
    overrides: ClassVar[bool] = False

    def values_for(self, source: type) -> dict[str, Any]:
        """The values given for `source`'s fields, keyed by its field names (overrides left unset are left out)."""
        names = next(names for cls, names in self.sources if cls is source)
        values = {theirs: getattr(self, ours) for ours, theirs in names.items()}
        return {name: value for name, value in values.items() if not (self.overrides and value is None)}

    def check(self) -> None:
        for source, names in self.sources:
            try:
                source(**self.values_for(source))  # the source's own checks, on these values
            except UsageError as error:
                raise UsageError(_renamed(str(error), names)) from None


def _renamed(message: str, names: Mapping[str, str]) -> str:
    """A source's message naming its settings as the derived group names them. Only names of several words are
    replaced: a one-word name (strategy) is also a word of the sentences around it."""
    for ours, theirs in names.items():
        if ours != theirs and "_" in theirs:
            message = re.sub(rf"\b{theirs}\b", ours, message)
    return message


def derive(
    name: str,
    *sources: type,
    only: Iterable[str] | None = None,
    rename: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    overrides: bool = False,
    note: str | Mapping[str, str] = "",
    choices: Mapping[str, tuple[Any, ...]] | None = None,
    unset: Mapping[str, str] | None = None,
    base: type[Derived] = Derived,
) -> type:
    """A group named `name` made of the settings of `sources` (all of them, or those named in `only`), each keeping
    its source's type, help text, choices and checks.

    `rename` shows a setting under another name (and so another flag and config key; the source's name stays an
    alias, so both flags work), `defaults` gives it another default. With `overrides` every default is None,
    meaning "not set": a tool's override of what a script asks for; `note` (one text, or one per setting) is added
    to the help to say what the setting means here, and `choices` narrows a setting's choices to those a tool
    handles (simulate models the data-parallel strategies). `unset` says what a setting's None default means here,
    in place of the "(default: ...)" its help ends with (a recipe launches one process unless told, `multigpu run`
    one per GPU). `base`, a subclass of Derived, may add values the sources take from elsewhere (a recipe's log_dir
    is its save_dir).
    """
    rename, defaults, narrowed, unset = dict(rename or {}), dict(defaults or {}), dict(choices or {}), dict(unset or {})
    fields, mapping = [], []
    for source in sources:
        hints = typing.get_type_hints(source)
        chosen = [field for field in dataclasses.fields(source) if only is None or field.name in only]
        for field in chosen:
            added = note.get(field.name, "") if isinstance(note, Mapping) else note
            help_text = field.metadata.get("help", "")
            if field.name in unset:
                help_text = f"{help_text.split(' (default:')[0]}{added} (default: {unset[field.name]})"
            else:
                help_text += added
            metadata = {**field.metadata, "help": help_text}
            shown = rename.get(field.name, field.name)
            if shown != field.name:  # the source's name stays a name of the setting: a flag it may be known by
                metadata["aliases"] = tuple(a for a in (field.name, *aliases(field)) if a != shown)
            if field.name in narrowed:
                if not set(narrowed[field.name]) <= set(metadata.get("choices", ())):
                    raise TypeError(f"derive({name!r}): {narrowed[field.name]} are not choices of {field.name}")
                metadata["choices"] = tuple(narrowed[field.name])
            default = None if overrides else defaults.get(field.name, field.default)
            kind = hints[field.name] | None if overrides else hints[field.name]
            fields.append((shown, kind, dataclasses.field(default=default, metadata=metadata)))
        mapping.append((source, {rename.get(field.name, field.name): field.name for field in chosen}))
    found = {theirs for _, names in mapping for theirs in names.values()}
    unknown = (set(only or ()) | set(rename) | set(defaults) | set(narrowed) | set(unset)) - found
    if unknown:
        raise TypeError(f"derive({name!r}): no setting {sorted(unknown)} in {[s.__name__ for s in sources]}")
    made = dataclasses.make_dataclass(name, fields, bases=(base,))
    made.sources, made.overrides = tuple(mapping), overrides
    return made


def setting_names(config: type) -> tuple[str, ...]:
    """The names of a config's settings, in order."""
    return tuple(field.name for field in dataclasses.fields(config))


@dataclass
class TrainingSettings(Settings):
    """What one optimizer step is: its number format, its micro-batches, its clipping, and the seed."""

    precision: str = setting("32", "number format for training", choices=PRECISIONS)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step")
    global_batch_size: int | None = setting(
        None,
        "samples per optimizer step over all processes, whatever their number: engine.dataloader derives "
        "grad_accum_steps from it as global_batch_size / (batch_size x data-parallel processes)",
    )
    max_grad_norm: float | None = setting(None, "clip the global gradient norm to this")
    seed: int = setting(0, "seed for model init, data order and sampling (the same on every rank)")

    def check(self) -> None:
        # Each range is written as what passes, so that nan, for which every comparison is false, never does.
        Precision(self.precision)
        require(
            (self.grad_accum_steps >= 1, f"grad_accum_steps must be 1 or more (got {self.grad_accum_steps})."),
            (
                self.global_batch_size is None or self.global_batch_size >= 1,
                f"global_batch_size must be 1 or more (got {self.global_batch_size}); leave it unset for none.",
            ),
            (
                self.global_batch_size is None or self.grad_accum_steps == 1,
                "global_batch_size derives grad_accum_steps from the number of processes; give one of the two, "
                f"not both (got grad_accum_steps {self.grad_accum_steps}).",
            ),
            (
                self.max_grad_norm is None or 0 < self.max_grad_norm < math.inf,
                f"max_grad_norm must be a positive finite number (got {self.max_grad_norm}); leave it unset for none.",
            ),
            (0 <= self.seed < 2**32, f"seed must be from 0 to 2**32 - 1, the seeds numpy takes (got {self.seed})."),
        )


@dataclass
class ComputeSettings(Settings):
    """How a step's work is done, leaving what it computes as it is."""

    def check(self) -> None:
        require(
            (
                self.compile or self.compile_backend == "inductor",
                f"compile_backend {self.compile_backend} is torch.compile's; add compile (--compile) or drop it.",
            ),
        )

    activation_checkpointing: str = setting(
        "none",
        "what each block (FSDP's units) keeps for backward: none; full, its inputs only, recomputing the rest; "
        "selective, also its matrix products' and attention's outputs; offload, everything, in host memory",
        choices=RECOMPUTE_MODES,
    )
    compile: bool = setting(
        False, "compile each block (FSDP's units) with torch.compile, after checkpointing and before sharding"
    )
    compile_backend: str = setting(
        "inductor",
        "torch.compile's backend under compile: inductor generates fused kernels; aot_eager traces the same "
        "graphs and runs them op by op (to tell a code-generation problem from a tracing one, or to trace quickly)",
        choices=("inductor", "aot_eager"),
    )
    float8: str = setting(
        "none",
        "train the blocks' linear layers in float8 (torchao; GPUs of compute capability 8.9 or newer, emulated on "
        "CPU): none; tensorwise, one scale per tensor (its all-gather in float8 under zero2, zero3 and hsdp); "
        "rowwise, one scale per row",
        choices=("none", "tensorwise", "rowwise"),
    )
    loss: str = setting(
        "plain",
        "how a language model's cross-entropy is computed: plain, from the whole logits tensor; chunked, the output "
        "head and the loss a slice of tokens at a time, so the whole logits tensor is never held; fused, "
        "Liger-Kernel's fused linear cross-entropy (GPUs)",
        choices=("plain", "chunked", "fused"),
    )
    liger: bool = setting(
        False, "replace a Hugging Face decoder's RMSNorm, RoPE and SwiGLU with Liger-Kernel's fused kernels (GPUs)"
    )
