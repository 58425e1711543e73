"""docs/cli.md, written from a parser: each verb's description, usage and a row per flag (its values and its help,
default included), so the reference says what --help says. `python scripts/cli_reference.py` rewrites the file;
tests/test_docs.py fails while the file differs from what this makes of `multigpu.cli.build_parser()`."""

from __future__ import annotations

import argparse
import textwrap

from multigpu.config.config_file import verb_parsers
from multigpu.config.flags import finite_float

WIDTH = 115  # the paragraphs' width; usage lines run to 118 (argparse's own wrapping)
INTRO = """\
# CLI reference

`multigpu VERB [options]`; `multigpu --help` and `multigpu VERB --help` print the same from the parser. `multigpu`
itself takes one flag, `--version`, which prints the version. Every mistake in the input is one sentence on
stderr, `multigpu: error: ...` (a flag a verb does not know or a value it does not take: `multigpu VERB: error:
...`, pointing at `multigpu VERB --help`), and exit code 2. A flag listed with two names takes either: the strategy
is `--multi-gpu` on train and finetune and `--strategy` elsewhere (bench's `--strategies`), and each takes both.

This file is generated from `multigpu.cli.build_parser()` by `python scripts/cli_reference.py`, and
`tests/test_docs.py` fails while it differs from what the parser says: each setting's help, choices and default are
written once, where the setting is defined, and the flags, config files and this page are made from them. What the
flags do together is in [guide.md](guide.md) (train, finetune, generate, run, export, demo) and
[tools.md](tools.md) (plan, env, verify, bench, simulate).
"""


def reference(parser: argparse.ArgumentParser) -> str:
    """The whole of docs/cli.md for `parser` (multigpu's)."""
    verbs = verb_parsers(parser)
    helps = {action.dest: action.help for action in _subcommands(parser)._choices_actions}
    rows = [f"| [`multigpu {verb}`](#multigpu-{verb}) | {helps[verb]} |" for verb in verbs]
    parts = [INTRO, "| verb | what it does |\n| --- | --- |\n" + "\n".join(rows) + "\n"]
    parts += [section(name, sub) for name, sub in verbs.items()]
    return "\n".join(parts)


def section(verb: str, parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=118)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    rows = [row(action) for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    return "\n".join(
        [
            f"## `multigpu {verb}`",
            "",
            textwrap.fill(parser.description or "", WIDTH),
            "",
            "```",
            formatter.format_help().strip(),
            "```",
            "",
            "| option | values | what it does |",
            "| --- | --- | --- |",
            *rows,
            "",
        ]
    )


def row(action: argparse.Action) -> str:
    """One flag's row: its names, the values it takes, and its help with its default (None: not said)."""
    if action.option_strings:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
    else:
        names = f"`{_positional(action)}` (positional)"
    text = (action.help or "").removesuffix(" (default: None)")
    return f"| {names} | {values(action)} | {text} |"


def values(action: argparse.Action) -> str:
    if action.choices is not None:
        return ", ".join(f"`{choice}`" for choice in action.choices)
    if action.nargs == 0:
        return "switch"
    if action.metavar is not None and action.option_strings:
        return action.metavar
    if not action.option_strings:
        return "optional" if action.nargs == "?" else ""
    return {int: "int", float: "number", finite_float: "number"}.get(action.type, "text")


def _positional(action: argparse.Action) -> str:
    if action.nargs == argparse.REMAINDER:
        return "ARGS..."
    return action.metavar or action.dest.upper()


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
