"""Objects named by a "package.module:name" string, imported when first used.

A process that needs one verb, one strategy or one public name (a worker of `multigpu run` before the user's script,
the CLI checking a flag) then pays for that module's imports alone.
"""

from __future__ import annotations

import importlib
from typing import Any


def imported(path: str) -> Any:
    """The object at "package.module:name", importing its module now if it is not yet."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
