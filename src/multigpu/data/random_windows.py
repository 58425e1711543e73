"""Random windows of a long token array, the way nanoGPT and most pretraining loops read one, made exact.

nanoGPT draws `torch.randint(len(data) - block_size, (batch_size,))` every step: windows with replacement, from a
random stream each process holds. Here sample i is the window at a counter-based hash of (seed, i), so the
windows depend on the global sample index only: the same for every world size (each rank reads its share of a
global batch), and a resumed run, which restarts at the loader's position, reads exactly the windows the
uninterrupted one would have.
"""

from __future__ import annotations

import numpy as np
import torch

from multigpu.core.errors import UsageError
from multigpu.data.shuffle import counter_hash


class RandomWindows:
    """A dataset whose sample i is (x, y) = tokens[s : s+block_size], tokens[s+1 : s+1+block_size] as int64 tensors,
    s = hash(seed, i) mod (len(tokens) - block_size): windows drawn with replacement, as nanoGPT's get_batch does.

    `tokens` is a 1-D torch tensor or numpy array (a `np.memmap` of a token file is read a window at a time).
    `samples` is the length: by default one window per block_size tokens, so an epoch reads about as many tokens
    as the array holds; every epoch reads the same windows (they depend on i only), so train one long epoch
    (give `samples`) or for a step budget rather than for several epochs. Read it with
    `engine.dataloader(windows, batch_size=..., shuffle=False)`: the windows are random already, and shuffling
    them, though allowed (it stays exact and resumable), only reorders the same draws.
    """

    def __init__(
        self, tokens: torch.Tensor | np.ndarray, block_size: int, samples: int | None = None, seed: int = 0
    ) -> None:
        if tokens.ndim != 1:
            raise UsageError(
                f"RandomWindows reads a 1-D token array, not one of shape {tuple(tokens.shape)}; flatten it first."
            )
        if not 0 < block_size < len(tokens):
            raise UsageError(
                f"block_size must be at least 1 and below the {len(tokens)} tokens (got {block_size}); "
                "use a shorter block or more tokens."
            )
        if samples is not None and samples < 1:
            raise UsageError(f"samples must be at least 1 (got {samples}); it is the number of windows an epoch reads.")
        self.tokens = tokens
        self.block_size = block_size
        self.samples = samples if samples is not None else max(1, len(tokens) // block_size)
        self.seed = seed

    def __len__(self) -> int:
        return self.samples

    def start(self, index: int) -> int:
        """Where sample `index`'s window starts."""
        return counter_hash(self.seed, index) % (len(self.tokens) - self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.samples:
            raise IndexError(f"window {index} of {self.samples}")
        first = self.start(index)
        window = self.tokens[first : first + self.block_size + 1]
        # One copy out of the array (a memmap's pages, a uint16 file) into int64, as the embedding wants.
        window = torch.from_numpy(window.astype(np.int64)) if isinstance(window, np.ndarray) else window.long()
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return f"RandomWindows({len(self.tokens)} tokens, block_size={self.block_size}, samples={self.samples})"
