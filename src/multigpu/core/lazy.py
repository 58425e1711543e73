"""Objects named by a "package.module:name" string, imported when first used.

A process that needs one verb, one strategy or one public name (a worker of `multigpu run` before the user's script,
the CLI checking a flag) then pays for that module's imports alone.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def imported(path: str) -> Any:
    """The object at "package.module:name", importing its module now if it is not yet."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def instance_of(value: Any, module: str, name: str) -> bool:
    """isinstance(value, module.name), without importing `module`: no object of a class can exist before its module
    is imported. DTensor and DCP's exceptions are tested for on every step and every error, and importing their
    modules costs each process about 0.6 s of CPU where nothing uses them (the CLI, ddp without checkpoints)."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(value, getattr(loaded, name))


def is_dtensor(tensor: Any) -> bool:
    return instance_of(tensor, "torch.distributed.tensor", "DTensor")
