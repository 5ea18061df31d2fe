"""Sample orders with no per-sample array: a keyed Feistel permutation, and the deterministic interleaving of a mixture.

`feistel_permute` maps positions ``[0, n)`` to a permutation of ``[0, n)`` drawn from a 64-bit key, element by element
(a balanced Feistel network over the next even power of two, cycle-walking back into range), so an epoch's order over
a corpus of any size costs O(batch) memory and time per batch. `mixture_assign` gives each global position a dataset:
the greedy rule of Megatron-LM's blended datasets (position p goes to the dataset furthest behind its share
``w_d * (p + 1)``), so after any n positions every dataset's count is within 1 of ``w_d * n``.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche hash of uint64 values."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def order_key(seed: int, *parts: int) -> int:
    """A 64-bit key from the seed and further integers (epoch, stream index), stable across NumPy versions.

    Each step ``key = mix(key * odd + part + c)`` is injective in (key, part), so distinct tuples of the same length
    give distinct keys.
    """
    key = np.asarray([seed & 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for part in (*parts, 0):
            key = _mix(key * _M2 + np.uint64(part & 0xFFFF_FFFF_FFFF_FFFF) + _GOLDEN)
    return int(key[0])


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> np.uint64(half_bits), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << np.uint64(half_bits)) | right


def feistel_permute(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """The images of positions (ints in [0, n)) under the keyed permutation of [0, n); int64, same shape."""
    positions = np.asarray(positions, dtype=np.int64)
    if n < 1 or (positions.size and (positions.min() < 0 or positions.max() >= n)):
        raise ValueError(f"positions must lie in [0, {n})")
    if n == 1:
        return np.zeros_like(positions)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _mix(np.uint64(key) + np.arange(1, ROUNDS + 1, dtype=np.uint64))
    with np.errstate(over="ignore"):
        x = positions.astype(np.uint64)
        todo = np.ones(x.shape, dtype=bool)
        while todo.any():  # cycle walking: the domain is < 4n, so a few rounds at most on average
            x[todo] = _feistel(x[todo], half_bits, keys)
            todo = x >= np.uint64(n)
    return x.astype(np.int64)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True, stream: int = 0) -> np.ndarray:
    """The whole order of one epoch of a stream as an array (tests; the loader never materialises it)."""
    positions = np.arange(num_samples, dtype=np.int64)
    return feistel_permute(positions, num_samples, order_key(seed, epoch, stream)) if shuffle else positions


def normalise_weights(weights: list[float]) -> np.ndarray:
    """Weights as float64 shares that sum to 1; ValueError for none, a negative one or an all-zero list."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"mixture weights {weights} must be >= 0 with a positive sum")
    return w / w.sum()


def mixture_assign(shares: np.ndarray, counts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Datasets of the next n positions and each one's index within its dataset, given the counts so far.

    counts[d] = positions already given to dataset d (their sum is the current global position). Returns
    (dataset per position, that dataset's running index per position); ``counts`` is not modified.
    """
    counts = counts.astype(np.int64).copy()
    position = int(counts.sum())
    datasets = np.empty(n, dtype=np.int64)
    indices = np.empty(n, dtype=np.int64)
    for i in range(n):
        d = int(np.argmax(shares * (position + i + 1) - counts))
        datasets[i], indices[i] = d, counts[d]
        counts[d] += 1
    return datasets, indices
