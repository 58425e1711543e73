"""Config files written: `multigpu config VERB`'s commented file (and the questions it asks), and the `config.yaml`
a run leaves in its directory. Each is written from the verb's parser, the schema config/config_file.py reads them
with, so what is written reads back as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import yaml

from multigpu.config.config_file import action_kind, defaults, expected_values, file_format, settings
from multigpu.config.flags import with_default
from multigpu.core.atomic import write_file
from multigpu.core.errors import UsageError

YES, NO = ("y", "yes", "true"), ("n", "no", "false")
#: What `multigpu config VERB` asks, where VERB has it: the settings users change most often.
QUESTIONS = ("method", "nproc", "multi_gpu", "strategy", "precision", "batch_size", "grad_accum_steps", "save_dir")
RUN_CONFIG = "config.yaml"


# -- the commented file ----------------------------------------------------------------------------------------
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
    kind = action_kind(action)
    if kind == "bool":
        if text.lower() in YES + NO:
            return text.lower() in YES
        raise UsageError(f"{text!r} is no answer to a yes-or-no question; type yes or no.")
    try:
        value = action.type(text) if action.type is not None else text
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise UsageError(f"{text!r} is not {expected_values(action).removesuffix(' or null')}; type one.") from None
    if action.choices is not None and value not in action.choices:
        raise UsageError(f"{text!r} is not {expected_values(action).removesuffix(' or null')}; type one of them.")
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
