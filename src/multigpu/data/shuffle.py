"""Random orders computed an index at a time: a keyed permutation of [0, n) and a counter-based hash.

Neither holds anything per sample, so a loader over 10^9 samples starts as fast as one over 10: the sample at
position p of an epoch is `Permutation(n, seed, epoch)(p)`, computed when a batch needs it, the same on every
rank and for every world size.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_ROUNDS = 6  # four suffice for a keyed Feistel network with random round functions; two more for margin
_MIX = 0x45D9F3B  # below 2**31: a 32-bit value times it stays under 2**63, so int64 never overflows
# numpy, not torch: a batch is a few hundred indices at most, and numpy's per-operation cost is a tenth of torch's.
# Positions are computed a chunk at a time: the network's ~100 numpy calls then serve many batches instead of one,
# which takes a step's share of them from ~0.1 ms to a few microseconds, for 32 KiB held.
_CHUNK = 4096


def mix64(value: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers whose outputs look independent."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def counter_hash(seed: int, counter: int) -> int:
    """A 64-bit pseudo-random number for (seed, counter): random access into one random stream per seed."""
    return mix64(mix64(seed & _MASK64) ^ (counter & _MASK64))


def _mix32(values: np.ndarray) -> np.ndarray:
    values = ((values ^ (values >> 16)) * _MIX) & _MASK32
    values = ((values ^ (values >> 16)) * _MIX) & _MASK32
    return values ^ (values >> 16)


class Permutation:
    """A pseudo-random permutation of [0, n) keyed by (seed, epoch), evaluated per index in O(1) time and memory.

    A balanced Feistel network permutes the smallest even-bit power of two >= n (under 4n); an image outside
    [0, n) is sent through the network again until it lands inside (cycle walking), which keeps it a bijection
    of [0, n) and takes under 4 rounds of the network on average.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if not 1 <= n <= 1 << 62:
            raise ValueError(f"a permutation needs 1 to 2**62 elements, not {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._keys = [counter_hash(counter_hash(seed, epoch), r) & _MASK32 for r in range(_ROUNDS)]
        self._chunk: tuple[int, np.ndarray] = (0, np.empty(0, dtype=np.int64))  # (first position, its elements)

    def _network(self, values: np.ndarray) -> np.ndarray:
        mask = (1 << self.half) - 1
        left, right = values >> self.half, values & mask
        for key in self._keys:
            left, right = right, left ^ (_mix32(right ^ key) & mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray | range) -> np.ndarray:
        """The elements at `positions` (ascending values in [0, n): an int64 array or a range) of the permuted
        order."""
        if not len(positions):
            return np.asarray(positions, dtype=np.int64)
        low, high = int(positions[0]), int(positions[-1])
        start, chunk = self._chunk
        if not start <= low <= high < start + len(chunk):
            start = low - low % _CHUNK
            if high >= start + _CHUNK:  # wider than a chunk: computed as it is
                return self._elements(np.asarray(positions, dtype=np.int64))
            self._chunk = start, chunk = start, self._elements(np.arange(start, min(start + _CHUNK, self.n)))
        if isinstance(positions, range):  # a batch's positions: a slice of the chunk, no index array to build
            return chunk[positions.start - start : positions.stop - start : positions.step]
        return chunk[np.asarray(positions, dtype=np.int64) - start]

    def _elements(self, positions: np.ndarray) -> np.ndarray:
        values = self._network(positions)
        outside = values >= self.n
        while outside.any():
            values[outside] = self._network(values[outside])
            outside = values >= self.n
        return values
