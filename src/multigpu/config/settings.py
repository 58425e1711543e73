"""Settings, each defined once: a dataclass field holds its type (the annotation), default, help text and choices,
and its group's `check` holds its checks.

Groups compose by inheritance: EngineConfig is every group the Engine reads, each defined in the lowest layer that
reads it (the planner's in core, a strategy's own options in its file). A verb that shows settings of another
config (some of them, or under its own defaults or flag names: train's `--multi-gpu` is the Engine's strategy,
verify's overrides default to the script's own) declares each as a field of its own config whose value is
`shown(Source)` or `override(Source)`: the field keeps the one definition (help, choices, checks), and building the
config builds the source from those values, so the source's checks run. A config that shows many takes them as a
group (`_engine = shown_group(EngineConfig, omit=...)`, `override_group`) and declares only those it shows
otherwise (another default, note or flag name). Every field of every config is thus written in a class body, its
own or its source's, where a reader finds it. The CLI's flags, config files, `multigpu
config VERB` and docs/cli.md are all made from the fields (config/flags.py, config/config_file.py and
config/config_writer.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from multigpu.config.precision import PRECISIONS, Precision
from multigpu.core.errors import UsageError, require

#: What activation_checkpointing may be (transforms/recompute.py says what each recomputes).
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


SHOWS = "shows"  # a shown field's metadata key: the Shown it was declared with, its source's name filled in
SOURCE_DEFAULT: Any = object()  # the default of a shown setting that keeps its source's


@dataclass(frozen=True)
class Shown:
    """A setting of another config (`source`) that a config shows: see `shown` and `override`."""

    source: type
    name: str | None = None  # the source's name for it; None: the field's own
    default: Any = SOURCE_DEFAULT
    note: str = ""
    unset: str | None = None
    choices: tuple[Any, ...] | None = None
    override: bool = False

    def field(self, owner: type, attribute: str, declared: Any) -> dataclasses.Field:
        """The field `owner.attribute` stands for: the source's definition, with this config's default, note and
        choices; refuses (TypeError, at import) a setting the source lacks and a type that is not the source's."""
        theirs = self.name or attribute
        original = {field.name: field for field in dataclasses.fields(self.source)}.get(theirs)
        if original is None:
            raise TypeError(f"{owner.__name__}.{attribute}: {self.source.__name__} has no setting {theirs!r}")
        defined = _type_hints(self.source)[theirs]
        expected = defined | None if self.override else defined
        if declared != expected:
            raise TypeError(f"{owner.__name__}.{attribute} is declared {declared}, but {theirs}'s type is {expected}")
        help_text = original.metadata.get("help", "")
        if self.unset is not None:
            help_text = f"{help_text.split(' (default:')[0]}{self.note} (default: {self.unset})"
        else:
            help_text += self.note
        metadata = {**original.metadata, "help": help_text, SHOWS: dataclasses.replace(self, name=theirs)}
        if attribute != theirs:  # the source's name stays a name of the setting: a flag it may be known by
            metadata["aliases"] = tuple(a for a in (theirs, *aliases(original)) if a != attribute)
        if self.choices is not None:
            if not set(self.choices) <= set(metadata.get("choices", ())):
                raise TypeError(f"{owner.__name__}.{attribute}: {self.choices} are not choices of {theirs}")
            metadata["choices"] = self.choices
        kept = original.default if self.default is SOURCE_DEFAULT else self.default
        default = None if self.override else kept  # an override's None: not set, the script's own
        return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def _type_hints(source: type) -> dict[str, Any]:
    return typing.get_type_hints(source)


def shown(
    source: type,
    name: str | None = None,
    *,
    default: Any = SOURCE_DEFAULT,
    note: str = "",
    unset: str | None = None,
    choices: Iterable[Any] | None = None,
) -> Any:
    """A setting of `source` shown by another config, declared there as `field: type = shown(Source)`: the field
    keeps `source`'s definition of the setting `name` (the field's own name, unless given): its help text and
    choices, and its checks (the config builds `source` from the values it shows). Its type is written again, for
    readers and type checkers, and refused at import unless it is the definition's.

    A field named otherwise (train's `multi_gpu: str = shown(EngineConfig, "strategy")`) is another flag and config
    key for the setting; the source's name stays an alias, so both work. `default` gives it another default; `note`
    is added to its help, to say what it means here; `unset` says what its None default means here, in place of
    the "(default: ...)" its help ends with (a recipe launches one process unless told, `multigpu run` one per
    GPU); `choices` narrows its choices to those this config handles (simulate models the data-parallel
    strategies)."""
    return Shown(source, name, default, note, unset, None if choices is None else tuple(choices))


def override(source: type, name: str | None = None, *, note: str = "") -> Any:
    """A setting of `source` as a tool's override of what a script asks for, declared as `field: type | None =
    override(Source)`: None, its default, means "not set" (the script keeps its own value, and no check runs on
    it); a value given is checked as `source` checks it. Otherwise as `shown`."""
    return Shown(source, name, note=note, override=True)


@dataclass(frozen=True)
class ShownGroup:
    """Several settings of `source` that a config shows at once: see `shown_group` and `override_group`."""

    source: type
    settings: tuple[type | str, ...]
    omit: tuple[str, ...]
    note: str
    override: bool

    def names(self) -> list[str]:
        """The source's names of the settings, in order (a group's fields in its order; none given: every setting
        of the source); refuses (TypeError, at import) a name or group that is not the source's."""
        own = setting_names(self.source)
        if not self.settings:
            names = list(own)
        else:
            names = []
            for item in self.settings:
                names += setting_names(item) if isinstance(item, type) else [item]
        missing = [name for name in [*names, *self.omit] if name not in own]
        if missing:
            raise TypeError(f"{self.source.__name__} has no setting(s) {', '.join(missing)}")
        return [name for name in names if name not in self.omit]

    def entries(self, declared: Mapping[tuple[type, str], str]) -> dict[str, Any]:
        """{field name: (type, Shown)} of the group's settings, in order; None for one the config declares itself
        (under another default, note or name, or in a base), which keeps its declaration (`declared`: (source, the
        source's name) -> the field's name)."""
        hints = _type_hints(self.source)
        found: dict[str, Any] = {}
        for name in self.names():
            ours = declared.get((self.source, name))
            if ours is not None:
                found[ours] = None
            else:
                found[name] = (
                    hints[name] | None if self.override else hints[name],
                    Shown(self.source, name, note=self.note, override=self.override),
                )
        return found


def shown_group(source: type, *settings: type | str, omit: Iterable[str] = (), note: str = "") -> Any:
    """Settings of `source` shown by another config all at once, declared in its body as `_name =
    shown_group(Source, ...)`: each as `field: type = shown(Source, note=note)` would declare it, in that place of
    the body. `settings` are groups of `source`'s settings (the classes it is made of, all their fields) or names;
    none: every setting of `source`; `omit` leaves some out. A setting of the group that the config declares itself
    (`log_every: int = shown(EngineConfig, default=10)`, train's `multi_gpu`), in its body or a base's, keeps that
    declaration, and takes its place in the group's order (a base's field keeps the base's place): so a config
    writes only the settings it shows otherwise than `source` defines them."""
    return ShownGroup(source, tuple(settings), tuple(omit), note, override=False)


def override_group(source: type, *settings: type | str, note: str = "") -> Any:
    """Settings of `source` as a tool's overrides all at once (`override` says what one is), as `shown_group`."""
    return ShownGroup(source, tuple(settings), (), note, override=True)


def _expand_groups(cls: type) -> None:
    """Each `shown_group` of `cls`'s body becomes its fields' annotations and `Shown` markers, in its place: the
    body's annotations are rewritten in order, a setting the config declares itself moved into the group's place."""
    body = dict(vars(cls))
    groups = {name: value for name, value in body.items() if isinstance(value, ShownGroup)}
    if not groups:
        return
    annotations = dict(body.get("__annotations__", {}))
    declared = {(value.source, value.name or name): name for name, value in body.items() if isinstance(value, Shown)}
    inherited = {name for base in cls.__mro__[1:] for name in getattr(base, "__dataclass_fields__", {})}
    for base in cls.__mro__[1:]:
        for field in getattr(base, "__dataclass_fields__", {}).values():
            if (shows := field.metadata.get(SHOWS)) is not None:
                declared.setdefault((shows.source, shows.name), field.name)
    expanded = {name: group.entries(declared) for name, group in groups.items()}
    made = [ours for entries in expanded.values() for ours, entry in entries.items() if entry is not None]
    clashing = sorted({ours for ours in made if ours in annotations or ours in inherited or made.count(ours) > 1})
    if clashing:  # a setting of its own under the name, or a group's twice: one field would hide the other
        raise TypeError(f"{cls.__name__}: {', '.join(clashing)} declared otherwise too; omit it from the group")
    placed = {ours for entries in expanded.values() for ours in entries}
    ordered: dict[str, Any] = {name: kind for name, kind in annotations.items() if name not in body}
    for name in body:
        if name in expanded:
            for ours, entry in expanded[name].items():
                if entry is None:  # declared by the config: its own annotation (a base's keeps the base's place)
                    if ours in annotations:
                        ordered[ours] = annotations[ours]
                else:
                    ordered[ours] = entry[0]
                    setattr(cls, ours, entry[1])
            delattr(cls, name)
        elif name in annotations and name not in placed:
            ordered[name] = annotations[name]
    cls.__annotations__ = ordered


def shown_sources(config: type) -> dict[type, dict[str, str]]:
    """Each config whose settings `config` shows, with {name in `config`: name in the source} for each setting."""
    found: dict[type, dict[str, str]] = {}
    for field in dataclasses.fields(config):
        shows = field.metadata.get(SHOWS)
        if shows is not None:
            found.setdefault(shows.source, {})[field.name] = shows.name
    return found


def _renamed(message: str, names: Mapping[str, str]) -> str:
    """A source's message naming its settings as the config that shows them names them. Only names of several
    words are replaced: a one-word name (strategy) is also a word of the sentences around it."""
    for ours, theirs in names.items():
        if ours != theirs and "_" in theirs:
            message = re.sub(rf"\b{theirs}\b", ours, message)
    return message


class Settings:
    """A group of settings (a dataclass). Once built, a value outside its setting's choices is refused; each config
    whose settings it shows (`shown`, `override`) is built from their values, so that its checks run; then each
    class's own `check` runs, base groups first, so a config made of several groups checks each of them."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Before @dataclass reads the class: each `shown(...)` becomes the field it stands for.
        super().__init_subclass__(**kwargs)
        _expand_groups(cls)
        marked = {name: value for name, value in vars(cls).items() if isinstance(value, Shown)}
        if marked:
            declared = typing.get_type_hints(cls)
            for name, marker in marked.items():
                setattr(cls, name, marker.field(cls, name, declared[name]))

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            choices, value = field.metadata.get("choices"), getattr(self, field.name)
            if choices is not None and value is not None and value not in choices:
                raise UsageError(f"Unknown {field.name} {value!r}; choose one of {', '.join(map(str, choices))}.")
        for source, names in shown_sources(type(self)).items():
            try:
                source(**self.values_for(source))  # the source's own checks, on these values
            except UsageError as error:
                raise UsageError(_renamed(str(error), names)) from None
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("check")
            if check is not None:
                check(self)

    def values_for(self, source: type) -> dict[str, Any]:
        """The values given to the settings of `source` this config shows, keyed by `source`'s names (an override
        left unset is left out: what it overrides keeps its own)."""
        values = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            shows, value = field.metadata.get(SHOWS), getattr(self, field.name)
            if shows is not None and shows.source is source and not (shows.override and value is None):
                values[shows.name] = value
        return values


class StrategyOptions(Settings):
    """A group of settings that only some strategies take (their constructor arguments): the strategy registry
    refuses a value other than the default for a strategy that does not take it."""


def strategy_option_fields() -> list[tuple[type, dataclasses.Field]]:
    """(group, field) of every strategy option: each StrategyOptions group's fields (EngineConfig is made of them)."""
    return [(group, field) for group in StrategyOptions.__subclasses__() for field in dataclasses.fields(group)]


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
            # global_batch_size with grad_accum_steps: strategies/compatibility.py's table of what composes.
            (
                self.max_grad_norm is None or 0 < self.max_grad_norm < math.inf,
                f"max_grad_norm must be a positive finite number (got {self.max_grad_norm}); leave it unset for none.",
            ),
            (0 <= self.seed < 2**32, f"seed must be from 0 to 2**32 - 1, the seeds numpy takes (got {self.seed})."),
        )


@dataclass
class ComputeSettings(Settings):
    """How a step's work is done, leaving what it computes as it is (compile_backend without compile is refused by
    strategies/compatibility.py's table of what composes)."""

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
