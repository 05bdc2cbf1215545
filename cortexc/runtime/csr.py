"""CSR (compressed sparse row) helpers: a row's items are ``idx[ptr[r]:ptr[r+1]]``.

The forest keeps its children and parents this way and the runtime relinks
them by level order; both need the same two vectorised steps, kept here so
neither reaches into the other's private names.
"""

from __future__ import annotations

import numpy as np

__all__ = ["counts_to_ptr", "gather_segments"]


def counts_to_ptr(counts: np.ndarray) -> np.ndarray:
    """CSR offsets (length n+1, starting at 0) from per-row counts."""
    ptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def gather_segments(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Concatenate ``idx[ptr[r]:ptr[r+1]]`` for every r in ``rows``, without a loop."""
    starts = ptr[rows]
    lengths = ptr[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return idx[:0]
    # Position k of the output belongs to segment s; its source is starts[s] + (k - first_k[s]).
    first_k = np.cumsum(lengths) - lengths
    positions = np.repeat(starts - first_k, lengths) + np.arange(total, dtype=np.int64)
    return idx[positions]
