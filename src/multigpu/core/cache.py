"""Where multigpu keeps what it builds once and reuses (converted model weights, tokenised data sets)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """MULTIGPU_CACHE, else ~/.cache/multigpu."""
    return Path(os.environ.get("MULTIGPU_CACHE", Path.home() / ".cache" / "multigpu"))
