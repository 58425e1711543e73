"""The one exception type for mistakes a user can fix; the CLI turns it into one sentence and exit code 2."""


class UsageError(ValueError):
    """A configuration or input that cannot run; the message says what to do instead."""

    #: Raised alike on every rank of a job (after they agreed on it): only rank 0 need print it.
    on_every_rank: bool = False


def require(*checks: tuple[bool, str]) -> None:
    """Raises the message of the first (condition, message) pair whose condition is false."""
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
