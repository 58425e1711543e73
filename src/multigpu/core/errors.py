"""The one exception type for mistakes a user can fix, and the one place it becomes a sentence and exit code 2."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from multigpu.core.launcher_notes import USAGE_ERROR, launched, note_for_launcher


class UsageError(ValueError):
    """A configuration or input that cannot run; the message says what to do instead."""

    #: Raised alike on every rank of a job (after they agreed on it): only rank 0 need print it.
    on_every_rank: bool = False


class Explained(RuntimeError):
    """A fault whose message is the whole story (which rank, where, what to do): said in one sentence, without a
    traceback; under `multigpu run` the launcher says it once for every rank that raised it."""


def shown_path(path: object) -> str:
    """A path as a message shows it: whole, or its start and length where it is too long to read."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:60]}[...] ({len(text)} characters)"


def require(*checks: tuple[bool, str]) -> None:
    """Raises the message of the first (condition, message) pair whose condition is false."""
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def exit_on_usage_error(main: Callable[[], int | None]) -> int:
    """Runs `main` and returns its exit code (None counts as 0); a UsageError becomes one line on stderr,
    `multigpu: error: <sentence>`, and exit code 2.

    The only place that translation happens: library code raises, and the entry points call this: `multigpu`'s
    `cli.main`, the `python -m` mains of the recipes and tools (`torchrun -m multigpu.recipes.train ...` gets
    the same one line and exit code 2 as the CLI), and each worker of `multigpu run` around the user's script.
    A worker of `multigpu run` prints nothing: it leaves the sentence for the launcher, which prints the first
    rank's once. Elsewhere, an error every rank raises alike is printed by rank 0 alone.
    """
    try:
        return main() or 0
    except UsageError as error:
        report_usage_error(error)
        sys.exit(2)


def report_usage_error(error: UsageError) -> None:
    if launched():
        # The time orders the ranks' errors: the launcher prints the first one raised.
        note_for_launcher(f"{USAGE_ERROR}{os.environ['RANK']}", f"{time.time_ns()} {error}")
    elif not error.on_every_rank or os.environ.get("RANK", "0") == "0":
        print(f"multigpu: error: {error}", file=sys.stderr)


def first_sentence(error: BaseException) -> str:
    """An exception's message as one line, up to its first full stop (library messages go on with advice)."""
    text = " ".join(str(error).split())
    return text.split(". ", 1)[0].rstrip(".") or type(error).__name__
