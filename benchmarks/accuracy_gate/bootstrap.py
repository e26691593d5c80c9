"""95% intervals by the bootstrap over chunks: positions of one chunk share their
context, so they are not independent; chunks are (they start from an empty cache)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def chunk_bootstrap(n_chunks: int, per_chunk: int, statistic: Callable[[np.ndarray], float],
                    resamples: int = 1000, seed: int = 57,
                    level: float = 0.95) -> tuple[float, float, float]:
    """(value, low, high): `statistic(index)` on all positions, and the percentile
    interval of it over `resamples` draws of n_chunks chunks with replacement, where
    `index` selects positions (chunk c holds positions c*per_chunk ..+per_chunk)."""
    everything = np.arange(n_chunks * per_chunk)
    value = float(statistic(everything))
    rng = np.random.default_rng(seed)
    offsets = np.arange(per_chunk)
    draws = np.empty(resamples)
    for b in range(resamples):
        picked = rng.integers(0, n_chunks, n_chunks)
        draws[b] = statistic((picked[:, None] * per_chunk + offsets).ravel())
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return value, float(low), float(high)
