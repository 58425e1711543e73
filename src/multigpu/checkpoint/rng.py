"""Each rank's random number generators (torch's, CUDA's, numpy's and Python's), saved and restored with its
checkpoint so that a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# numpy's RNG state is a tuple holding a uint32 array; unpickling it takes these globals. The array's reconstructor
# moved from numpy.core to numpy._core in numpy 2 (an array's reduce names it in either); numpy 1's files use the old.
_reconstruct_array = np.empty(0).__reduce__()[0]
NUMPY_RNG_GLOBALS = [
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    _reconstruct_array,
    (_reconstruct_array, "numpy.core.multiarray._reconstruct"),
]


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
