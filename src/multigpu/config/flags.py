"""Typed dataclass configs <-> argparse: every field is one flag, its metadata the help, so --help is complete."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

from multigpu.core.errors import UsageError, shown_path

T = TypeVar("T")


class Formatter(argparse.HelpFormatter):
    """argparse's help, a flag's values shown once after all its names (`--multi-gpu, --strategy {auto,...}`), not
    after each of them."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        values = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {values}"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what was wrong and where the help is (the verb's own, for a verb's flags),
    exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """argparse's, except that arguments no verb knows are refused by the verb's parser: argparse leaves them
        to the top-level one, whose error would point at `multigpu --help` rather than the verb's."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._verb(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _verb(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the verb `parsed` was parsed by (this one, where it has no verbs)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; `float` -> float."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (base,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return base
    return annotation


def finite_float(text: str | float) -> float:
    """The type of every float flag: a number, and a finite one. float() also reads nan and inf, which no setting
    means: nan passes every range check (each comparison is false) and inf overflows what it reaches."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number, not {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"takes a finite number, not {text}")
    return value


def with_default(help_text: str, default: Any) -> str:
    """A flag's help ending in its default, unless the help already says in words what the default is (as
    "(default: one per node)", which says more than "None")."""
    return help_text if "(default" in help_text else f"{help_text} (default: {default})"


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` flag per dataclass field of `cls` (and one per alias the setting has); a float field's flag
    takes finite numbers only."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flags = [flag_of(name) for name in (field.name, *field.metadata.get("aliases", ()))]
        kind = _base_type(hints[field.name])
        help_text = field.metadata.get("help", "")
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
            continue
        group.add_argument(
            *flags,
            dest=field.name,
            type=finite_float if kind is float else kind,
            default=field.default,
            choices=field.metadata.get("choices"),
            metavar=field.metadata.get("metavar"),
            help=with_default(help_text, field.default),
        )


def flag_of(name: str) -> str:
    """A setting's flag: grad_accum_steps -> --grad-accum-steps."""
    return "--" + name.replace("_", "-")


def long_names(action: argparse.Action) -> list[str]:
    """The setting names an action's long flags spell (not a switch's --no- flag, which means the opposite)."""
    negated = isinstance(action, argparse.BooleanOptionalAction)
    return [
        flag[2:].replace("-", "_")
        for flag in action.option_strings
        if flag.startswith("--") and not (negated and flag.startswith("--no-"))
    ]


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Builds `cls` from the parsed flags; its __post_init__ validates them."""
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in vars(args).items() if name in names})


def config_to_argv(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild `config` (the inverse of add_config_arguments), to hand on to launched workers."""
    argv = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in skip or value is None:
            continue
        flag = flag_of(field.name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def check_path(
    path: str | Path,
    expect: Literal["file", "directory"],
    flag: str = "",
    what: str | None = None,
    advice: str = "check the path",
) -> Path:
    """`path` if it is the file or directory expected; else one sentence: that it does not exist (and `advice`),
    or what it is instead and what was expected (`what`, e.g. "a JSONL file of prompts")."""
    path = Path(path)
    name = f"{flag} {path}" if flag else str(path)
    try:
        if path.is_file() if expect == "file" else path.is_dir():
            return path
    except OSError as error:  # a name longer than the file system takes (ENAMETOOLONG), a loop of links, ...
        shown = f"{flag} {shown_path(path)}" if flag else shown_path(path)
        raise UsageError(f"{shown} cannot be looked up ({error.strerror}); pass another path.") from None
    if not path.exists():
        raise UsageError(f"{name} does not exist; {advice}.")
    found = "a directory" if path.is_dir() else "a file" if path.is_file() else "neither a file nor a directory"
    raise UsageError(f"{name} is {found}, but {what or 'a ' + expect} is expected; pass the {expect}'s path.")


def read_json(path: str | Path, how_to_get_it: str, flag: str = "", what: str = "a JSON file") -> Any:
    """A user-given JSON file, or one sentence on what is wrong with it: absent, not a file, not JSON, or holding
    NaN or Infinity (which Python's json reads, and which would surface far from the file as nan results)."""
    path = check_path(path, "file", flag, what, how_to_get_it)
    try:
        data = json.loads(path.read_text("utf-8"))
        found = _non_finite(data, "")
    except UnicodeDecodeError as error:
        raise UsageError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); pass {what}.") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}); fix it.") from None
    except OSError as error:
        raise UsageError(f"{path} cannot be read ({error.strerror}); {how_to_get_it}.") from None
    except RecursionError:  # from the reader, or from the walk over what it read
        raise UsageError(f"{path} nests lists or objects deeper than Python can follow; pass {what}.") from None
    if found is not None:
        key, value = found
        raise UsageError(
            f"{path}: {key or 'the top level'} is {json.dumps(value)}, but a finite number is expected; write one."
        )
    return data


def _non_finite(data: Any, key: str) -> tuple[str, float] | None:
    """The key path and value of the first NaN or infinity in `data`."""
    if isinstance(data, float) and not math.isfinite(data):
        return key, data
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for name, value in children:
        found = _non_finite(value, _key_path(key, name))
        if found is not None:
            return found
    return None


def _key_path(at: str, key: str | int | None) -> str:
    """How a message names a value: results[2].time_s."""
    if key is None:
        return at
    if isinstance(key, int):
        return f"{at}[{key}]"
    return f"{at}.{key}" if at else key


KIND_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "true or false",
    int: "an integer",
    float: "a number",
    type(None): "null",
}


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is(value: Any, kind: type) -> bool:
    """isinstance as JSON means it: true is no number, and an integer is a number."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _expected(
    kinds: tuple[type, ...], minimum: float | None, maximum: float | None, positive: bool, choices: tuple | None
) -> str:
    names = []
    for kind in kinds:
        name = KIND_NAMES[kind]
        if kind is list:
            name = "a non-empty list"
        elif kind is str and choices:
            name = ("one of " if len(choices) > 1 else "") + ", ".join(json.dumps(c) for c in choices)
        elif kind in (int, float):
            if minimum is not None and maximum is not None:
                name += f" from {minimum:g} to {maximum:g}"
            elif minimum is not None:
                name += f" of {minimum:g} or more"
            elif positive:
                name += " above 0"
        names.append(name)
    return " or ".join(names)


def json_value(
    data: Any,
    key: str | None,
    kind: type | tuple[type, ...],
    at: str = "",
    *,
    file: str | Path,
    optional: bool = False,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    items: type | None = None,
    advice: str = "fix the file",
) -> Any:
    """`data[key]` of a JSON file, checked, or one sentence naming the file, the key and what was expected.

    `key` may be a dotted path ("step_time_s.median"), or None for `data` itself; `at` is where `data` sits in the
    file ("cells[0]"), for the message. Kind float takes integers too and returns a float; true is no number; a
    list must not be empty, and its elements must be of kind `items` if given. An absent key gives None where
    `optional`; null is a value, allowed only where `kind` includes type(None).
    """
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if key is not None and "." in key:
        *parents, key = key.split(".")
        for parent in parents:
            data = json_value(data, parent, dict, at, file=file, optional=optional, advice=advice)
            if data is None:
                return None
            at = _key_path(at, parent)
    where = _key_path(at, key) or "the top level"
    expected = _expected(kinds, minimum, maximum, positive, choices)

    def refuse(found: str, wanted: str = expected) -> NoReturn:
        raise UsageError(f"{file}: {where} is {found}, but {wanted} is expected; {advice}.")

    if key is not None and not (isinstance(data, dict) and key in data):
        if optional:
            return None
        refuse("missing")
    value = data if key is None else data[key]
    kind = next((k for k in kinds if _is(value, k)), None)
    if kind is None:
        refuse(_describe(value))
    if kind in (int, float):
        low = (minimum is not None and value < minimum) or (positive and value <= 0)
        if not math.isfinite(value) or low or (maximum is not None and value > maximum):
            refuse(_describe(value))
        value = float(value) if kind is float else value
    if kind is list and not value:
        refuse(_describe(value))
    if kind is list and items is not None:
        for index, item in enumerate(value):
            if not _is(item, items):
                where = _key_path(where, index)
                refuse(_describe(item), KIND_NAMES[items])
    if kind is str and choices is not None and value not in choices:
        refuse(_describe(value))
    return value


def parse_list(text: str, flag: str, kind: type) -> list:
    """A flag's comma-separated values, each of `kind`, duplicates dropped, in order."""
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r} must be a comma-separated list, e.g. 1,2,4.") from None
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value.")
    return list(dict.fromkeys(values))


GROUP = re.compile(r"^(\d+)\s*[xX]\s*(\S.*)$")


def parse_groups(text: str, flag: str, value: Callable[[str], T], example: str) -> list[T]:
    """One value per GPU from a flag's comma-separated values, each alone or as COUNTxVALUE (4x80GB: four GPUs of
    80GB), in order. `value` reads one (raising ValueError, or UsageError with its own sentence)."""
    found: list[T] = []
    for part in (part.strip() for part in text.split(",")):
        group = GROUP.match(part)
        count, single = (int(group.group(1)), group.group(2)) if group else (1, part)
        try:
            if not part or count < 1:
                raise ValueError(part)
            found += [value(single.strip())] * count
        except UsageError:
            raise
        except ValueError:
            raise UsageError(
                f"{flag} {text!r} must list one value per GPU or COUNTxVALUE groups of them, e.g. {example}."
            ) from None
    return found
