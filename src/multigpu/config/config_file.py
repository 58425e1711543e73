"""Config files: `--config FILE` on every verb, `multigpu config VERB` to write one, and the `config.yaml` a run
leaves in its directory.

A verb's parser is the schema. A file's keys are the dests of the verb's flags and positionals, its values are
checked and converted by their argparse actions, and the generated file is written from the same actions, so
--help, the files and the flags cannot drift apart. The file's values become the parser's defaults and the
command line is parsed again over them: flags given there win, and the config dataclasses, built after parsing
as without a file, still validate the merged values.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import shlex
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import yaml

from multigpu.config.flags import check_path, finite_float, long_names, with_default
from multigpu.core.atomic import write_file
from multigpu.core.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}
NOT_SETTINGS = ("help", "config")  # dests a file cannot set: --help, and --config itself
# YAML 1.1 (PyYAML) reads 1e-4 and 1.5e3 as strings; a float flag takes them as the command line does.
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
YES, NO = ("y", "yes", "true"), ("n", "no", "false")
#: What `multigpu config VERB` asks, where VERB has it: the settings users change most often.
QUESTIONS = ("method", "nproc", "multi_gpu", "strategy", "precision", "batch_size", "grad_accum_steps", "save_dir")
RUN_CONFIG = "config.yaml"


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


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) or (action.nargs == 0 and isinstance(action.const, bool)):
        return "bool"
    if action.nargs in ("*", "+", argparse.REMAINDER) or isinstance(action.nargs, int):
        return "list"
    return {None: "str", str: "str", int: "int", float: "float", finite_float: "float"}.get(action.type, "text")


def _expected(action: argparse.Action) -> str:
    kind = _kind(action)
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
            f"{where} is {found}, but {_expected(action)} is expected; change the value or remove the key."
        )

    if value is None:
        if action.default is None:
            return None
        raise refuse()
    kind = _kind(action)
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


# -- writing ---------------------------------------------------------------------------------------------------
def defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {key: action.default for key, action in settings(parser).items()}


def help_text(action: argparse.Action, prog: str = "multigpu") -> str:
    """An action's help with argparse's %-placeholders filled in, its choices named, and without the default value
    it ends with (a file shows the value; a default said in words stays)."""
    params = {name: value for name, value in vars(action).items() if value is not argparse.SUPPRESS}
    text = ((action.help or "") % {**params, "prog": prog}).removesuffix(f" (default: {action.default})")
    if action.choices is not None:
        text += "; one of " + ", ".join(str(choice) for choice in action.choices)
    return text


def _yaml_entry(key: str, value: Any) -> str:
    return yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False, allow_unicode=True, width=10**6)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string, escapes and all


def render(parser: argparse.ArgumentParser, fmt: str, values: dict[str, Any], path: str) -> str:
    """The commented config file of `parser`'s verb holding `values`: each key under its help; a key whose value
    is None left commented out, since null is "not set" (and TOML has no null)."""
    lines = [
        f"# Settings for `{parser.prog} --config {shlex.quote(path)}`, one per flag (the flag's name with",
        "# underscores). A flag given on the command line overrides its value here; a key commented out or",
        "# removed keeps its default.",
    ]
    for key, action in settings(parser).items():
        lines.append("")
        value = values.get(key, action.default)
        text = help_text(action, parser.prog)
        if value != action.default:
            text = with_default(text, action.default)
        # Not at hyphens: the help is read back by joining its lines with spaces ("multi- process" otherwise).
        lines += textwrap.wrap(text, 116, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
        if value is None:
            lines.append(f"# {key}: null" if fmt == "yaml" else f"# {key} = ...")
        elif fmt == "yaml":
            lines += _yaml_entry(key, value).splitlines()
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def output(out: str | None, fmt: str | None, verb: str) -> tuple[Path | None, str]:
    """Where `multigpu config VERB` writes (None: stdout) and in which format: --format, else --out's extension,
    else YAML. A file --config could not read back is refused."""
    if out is None or out == "-":
        fmt = fmt or "yaml"
        return (None if out == "-" else Path(f"{verb}.{fmt}")), fmt
    by_extension = file_format(out, "--out")
    if fmt is not None and fmt != by_extension:
        raise UsageError(
            f"--format {fmt} does not match --out {out}, and --config reads a file by its extension; "
            f"name the file .{fmt} or drop --format."
        )
    return Path(out), by_extension


def write_text(path: Path, text: str, flag: str) -> None:
    """`text` at `path`, whole or not at all (a run's config.yaml is rewritten as the run goes)."""
    try:
        write_file(path, lambda partial: partial.write_text(text, "utf-8"), result=False)
    except OSError as error:
        raise UsageError(f"{flag} {path} cannot be written ({error.strerror}); choose another path.") from None


def write_config(
    parser: argparse.ArgumentParser,
    out: str | None,
    fmt: str | None,
    force: bool,
    ask_questions: bool,
    check: Callable[[dict[str, Any]], None] | None = None,
    stdin: TextIO | None = None,
    stderr: TextIO | None = None,
    stdout: TextIO | None = None,
) -> Path | None:
    """`multigpu config VERB`: the verb's commented config file, its defaults (and answers) as values. The
    streams default to sys's, looked up at the call (where a test may have replaced them)."""
    stdin, stderr, stdout = stdin or sys.stdin, stderr or sys.stderr, stdout or sys.stdout
    verb = parser.prog.split()[-1]
    path, fmt = output(out, fmt, verb)
    if path is not None and path.exists() and not force:
        raise UsageError(f"{path} exists already; pass --force to overwrite it, or choose another --out.")
    values = defaults(parser)
    if ask_questions:
        values = ask(parser, values, stdin, stderr, check)
    text = render(parser, fmt, values, "FILE" if path is None else str(path))
    if path is None:
        stdout.write(text)
        return None
    write_text(path, text, "--out")
    print(f"wrote {path}; use it with `{parser.prog} --config {shlex.quote(str(path))}`", file=stdout)
    return path


# -- the questions ---------------------------------------------------------------------------------------------
def from_answer(action: argparse.Action, text: str) -> Any:
    """A typed answer as the flag would take it, or one sentence saying what to type."""
    kind = _kind(action)
    if kind == "bool":
        if text.lower() in YES + NO:
            return text.lower() in YES
        raise UsageError(f"{text!r} is no answer to a yes-or-no question; type yes or no.")
    try:
        value = action.type(text) if action.type is not None else text
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise UsageError(f"{text!r} is not {_expected(action).removesuffix(' or null')}; type one.") from None
    if action.choices is not None and value not in action.choices:
        raise UsageError(f"{text!r} is not {_expected(action).removesuffix(' or null')}; type one of them.")
    return value


def _shown(value: Any) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def ask(
    parser: argparse.ArgumentParser,
    values: dict[str, Any],
    stdin: TextIO,
    stderr: TextIO,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """`values` with the answers to QUESTIONS that the verb has, asked on `stderr` and read from `stdin`: an
    empty answer keeps the value shown; a bad one (that `from_answer` or `check(values)` refuses, with a
    UsageError) is explained and asked again."""
    keys = settings(parser)
    values = dict(values)
    for name in (question for question in QUESTIONS if question in keys):
        action = keys[name]
        what = help_text(action, parser.prog)
        while True:
            stderr.write(f"{name}: {what} [{_shown(values[name])}]: ")
            stderr.flush()
            line = stdin.readline()
            if not line:
                raise UsageError(
                    f"The input ended before {name} was answered; answer every question, or pass --no-ask."
                )
            text = line.strip()
            if not text:
                break
            try:
                value = from_answer(action, text)
                if check is not None:
                    check({**values, name: value})
            except UsageError as error:
                stderr.write(f"  {error}\n")
                continue
            values[name] = value
            break
    return values


# -- a run's record --------------------------------------------------------------------------------------------
def save_settings(values: dict[str, Any], path: Path, verb: str, flag: str) -> Path:
    """`values` as the YAML file `multigpu VERB --config PATH` runs again with; every key, null included. `flag`:
    the one that named its directory, for the message should it not be writable."""
    header = (
        f"# The settings this `multigpu {verb}` ran with (defaults, --config file and flags merged);\n"
        f"# `multigpu {verb} --config {shlex.quote(str(path))}` runs with them again.\n"
    )
    body = yaml.safe_dump(values, sort_keys=False, default_flow_style=False, allow_unicode=True, width=10**6)
    write_text(path, header + body, flag)
    return path


def save_run_config(config: Any, directory: str | Path, verb: str) -> Path:
    """`directory`/config.yaml: every field of a recipe's `config` as it runs."""
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    return save_settings(values, Path(directory) / RUN_CONFIG, verb, "--save-dir")
