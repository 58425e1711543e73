"""Config files: `--config FILE` on every verb, read against the verb's parser (config/config_writer.py writes
them: `multigpu config VERB`, and the `config.yaml` a run leaves in its directory).

A verb's parser is the schema. A file's keys are the dests of the verb's flags and positionals, its values are
checked and converted by their argparse actions, and the generated file is written from the same actions, so
--help, the files and the flags cannot drift apart. The file's values become the parser's defaults and the
command line is parsed again over them: flags given there win, and the config dataclasses, built after parsing
as without a file, still validate the merged values.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from multigpu.config.flags import check_path, finite_float, long_names
from multigpu.core.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}
NOT_SETTINGS = ("help", "config")  # dests a file cannot set: --help, and --config itself
# YAML 1.1 (PyYAML) reads 1e-4 and 1.5e3 as strings; a float flag takes them as the command line does.
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


# -- the schema ------------------------------------------------------------------------------------------------
def verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subparser of each verb of `parser`."""
    return {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }


def settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The keys a config file of `parser`'s verb may hold, in --help order, and the action that checks each
    (the first, where two flags share a dest, as `run`'s --nproc and -n)."""
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest not in NOT_SETTINGS and action.dest != argparse.SUPPRESS:
            keys.setdefault(action.dest, action)
    return keys


def positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if not action.option_strings]


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` on a verb. Its positionals become optional to argparse, since the file may give them;
    parse_args still refuses a run that has them from neither."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from a YAML or TOML file whose keys are these flags' names with underscores; flags "
        f"given here override it (`multigpu config {parser.prog.split()[-1]}` writes one)",
    )
    for action in positionals(parser):
        action.required = False


def action_kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) or (action.nargs == 0 and isinstance(action.const, bool)):
        return "bool"
    if action.nargs in ("*", "+", argparse.REMAINDER) or isinstance(action.nargs, int):
        return "list"
    return {None: "str", str: "str", int: "int", float: "float", finite_float: "float"}.get(action.type, "text")


def expected_values(action: argparse.Action) -> str:
    kind = action_kind(action)
    if action.choices is not None:
        shown = [json.dumps(choice) if isinstance(choice, str) else str(choice) for choice in action.choices]
        text = "one of " + ", ".join(shown)
    else:
        text = {
            "bool": "true or false",
            "list": "a list of strings",
            "int": "an integer",
            "float": "a finite number",
        }.get(kind, "a string")
    return text + " or null" if action.default is None else text


def describe(value: Any) -> str:
    """A value as a message names it, in the files' own spelling."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 40 else text[:37] + '..."'
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """A file's `value` for `action`'s flag, as the command line would have given it; else one sentence naming
    `where` ("file: key"), what was found and what the flag takes. Null stands for "not set", so only a flag
    whose default is None takes it; an integer is taken for a float, and for a string (as `gpu_ids: 0`)."""

    found = describe(value)

    def refuse() -> UsageError:
        return UsageError(
            f"{where} is {found}, but {expected_values(action)} is expected; change the value or remove the key."
        )

    if value is None:
        if action.default is None:
            return None
        raise refuse()
    kind = action_kind(action)
    if isinstance(value, bool) != (kind == "bool"):
        raise refuse()
    if kind == "list":
        if not isinstance(value, list) or not all(
            isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in value
        ):
            raise refuse()
        return [str(item) for item in value]
    if kind == "int" and not isinstance(value, int):
        raise refuse()
    if kind == "float":
        if isinstance(value, str) and NUMBER.fullmatch(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)):
            raise refuse()
        try:
            value = finite_float(value)
        except (argparse.ArgumentTypeError, OverflowError):  # YAML's .nan and .inf, TOML's nan and inf, 1e999
            raise refuse() from None
    if kind in ("str", "text"):
        if isinstance(value, int):
            value = str(value)
        if not isinstance(value, str):
            raise refuse()
        if kind == "text":
            try:
                value = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise refuse() from None
    if action.choices is not None and value not in action.choices:
        raise refuse()
    return value


def defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {key: action.default for key, action in settings(parser).items()}


# -- reading ---------------------------------------------------------------------------------------------------
class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice, where safe_load keeps the last silently (as TOML
    refuses it), and a key that is a list or mapping, which names no setting. Refused before it is built: one
    built from aliases of aliases (a "billion laughs" of a few hundred bytes) would take minutes to compare."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "found a list or mapping as a key, where a name is expected", key_node.start_mark
                )
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"found {key!r} twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def file_format(path: str | Path, flag: str) -> str:
    """The format of `path`, by its extension: yaml or toml; anything else is refused."""
    found = FORMATS.get(Path(path).suffix.lower())
    if found is None:
        raise UsageError(
            f"{flag} {path} has neither a .yaml, .yml nor a .toml extension, which says how to read it; "
            "rename it to one of them."
        )
    return found


def read_mapping(path: str | Path, verb: str) -> dict[Any, Any]:
    """The top-level mapping of a YAML or TOML file (an empty YAML file: an empty one), or one sentence on what
    is wrong with the file."""
    fmt = file_format(path, "--config")
    path = check_path(path, "file", "--config", "a YAML or TOML file", f"write one with `multigpu config {verb}`")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise UsageError(f"--config {path} cannot be read ({error.strerror}); fix its permissions.") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"--config {path} is not UTF-8 text ({error.reason} at byte {error.start}); fix it.") from None
    try:
        data = tomllib.loads(text) if fmt == "toml" else yaml.load(text, Loader=UniqueKeyLoader)
    except RecursionError:
        raise UsageError(
            f"--config {path} nests lists or mappings deeper than its reader can follow; a config file holds one "
            "`key: value` per setting, so flatten it."
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"--config {path} is not valid TOML ({error}); fix it.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UsageError(f"--config {path} is not valid YAML ({problem}{where}); fix it.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(
            f"--config {path} holds {describe(data)} at the top level, but a mapping of settings is expected; "
            "write one `key: value` line per setting."
        )
    return data


def load_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A config file's settings for `parser`'s verb, checked and converted: {dest: value}.

    A key may be spelled as the flag is (grad-accum-steps) or as its dest (grad_accum_steps), or as another long
    flag of the setting (strategy for train's multi_gpu), once."""
    verb = parser.prog.split()[-1]
    data = read_mapping(path, verb)
    keys = settings(parser)
    also = {name: dest for dest, action in keys.items() for name in long_names(action)}
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        name = also.get(name, name)
        if name not in keys:
            close = difflib.get_close_matches(str(key).replace("-", "_"), list(keys), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"see `{parser.prog} --help` for its flags."
            raise UsageError(f"{path}: unknown key {key!r} for `{parser.prog}`; {hint}")
        if name in spelled:
            raise UsageError(f"{path}: {name} is given twice (as {spelled[name]!r} and {key!r}); keep one of them.")
        spelled[name] = key
        values[name] = convert(keys[name], value, f"{path}: {key}")
    return values


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with the file of the verb's --config (if given) under the command line.

    The first parse finds --config (where argparse puts it: not inside a script's own arguments); the file's
    values become the verb's defaults, and the second parse lets the flags given override them. A script's
    arguments belong to it: they come from the file only when the command line names no script."""
    args = parser.parse_args(argv)
    sub = verb_parsers(parser).get(getattr(args, "verb", None))
    if sub is None:
        return args
    path = getattr(args, "config", None)
    if path is not None:
        values = load_config(path, sub)
        first = args
        sub.set_defaults(**values)
        args = parser.parse_args(argv)
        previous = None
        for action in positionals(sub):
            named = previous is not None and getattr(first, previous.dest) is not None
            if action.nargs == argparse.REMAINDER and action.dest in values and not named:
                setattr(args, action.dest, values[action.dest])
            previous = action
    missing = [
        action.dest for action in positionals(sub) if action.nargs is None and getattr(args, action.dest) is None
    ]
    if missing:
        sub.error(f"the following arguments are required: {', '.join(missing)}")
    return args
