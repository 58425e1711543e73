"""The one exception type for mistakes a user can fix; the CLI turns it into one sentence and exit code 2."""


class UsageError(ValueError):
    """A configuration or input that cannot run; the message says what to do instead."""
