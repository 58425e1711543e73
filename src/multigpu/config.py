"""Typed dataclass configs <-> argparse: every field is one flag, its metadata the help, so --help is complete."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from multigpu.errors import UsageError

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what was wrong and where the help is, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; `float` -> float."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (base,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return base
    return annotation


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` flag per dataclass field of `cls`."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(hints[field.name])
        help_text = field.metadata.get("help", "")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
            continue
        group.add_argument(
            flag,
            type=kind,
            default=field.default,
            choices=field.metadata.get("choices"),
            metavar=field.metadata.get("metavar"),
            help=f"{help_text} (default: {field.default})",
        )


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
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def read_json(path: str | Path, how_to_get_it: str) -> Any:
    """A user-given JSON file, or one sentence on what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} does not exist; {how_to_get_it}.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}); fix it.") from None
