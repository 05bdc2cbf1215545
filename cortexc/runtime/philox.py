"""Philox-4x32-10 (Salmon et al. 2011) in NumPy, and the dropout masks of the `.cell` language.

The masks are a pure function of a 64-bit seed and an element's identity (the contract:
../shared/spec/cell-language.md, "Dropout"): the counter is ``(e, n, j, s)`` — element, node id, child slot
(0 per node, 1 + i for the i-th child), site — the key ``(seed mod 2^32, seed div 2^32)``, and an element is
kept iff the first output word is at least ``floor(p * 2^32)``. The interpreter computes them here, vectorised;
the kernels compute the same function inline (`cortexc.ir.ops`, the DROPOUT entry's C helper). Part of the
runtime: imports nothing from the compiler.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from cortexc.errors import InputError

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key bumps (golden ratio, sqrt(3) - 1)
ROUNDS = 10
SEED_LIMIT = 1 << 64
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32(counter: np.ndarray, key: tuple[int, int], rounds: int = ROUNDS) -> np.ndarray:
    """The Philox-4x32 block of every counter: `counter` is uint32 ``[..., 4]``, the result too."""
    c = np.asarray(counter, dtype=np.uint32).astype(np.uint64)
    c0, c1, c2, c3 = (c[..., i] for i in range(4))
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for round_index in range(rounds):
        if round_index:  # the key is bumped between rounds
            k0, k1 = (k0 + np.uint64(W0)) & _LOW, (k1 + np.uint64(W1)) & _LOW
        p0, p1 = np.uint64(M0) * c0, np.uint64(M1) * c2  # 32 x 32 -> 64 bits: never overflows uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _LOW, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _LOW
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def threshold(p: float) -> int:
    """``floor(p * 2^32)``: an element is dropped iff its word is below it (exact in float64)."""
    return math.floor(float(p) * 4294967296.0)


def scale(p: float) -> np.float32:
    """What a kept element is multiplied by: ``1 / (1 - p)`` in float32 (1 - p in float64, then rounded)."""
    return np.float32(1.0) / np.float32(1.0 - float(p))


def key_of(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def keep_mask(
    seed: int, site: int, p: float, node: np.ndarray | int, slot: np.ndarray | int, element: np.ndarray | int
) -> np.ndarray:
    """True where an element is kept; `node`, `slot` and `element` broadcast against each other."""
    node, slot, element = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (node, slot, element)))
    counter = np.stack([element, node, slot, np.full(element.shape, site, np.int64)], axis=-1).astype(np.uint32)
    return philox4x32(counter, key_of(seed))[..., 0] >= np.uint32(threshold(p))


@dataclass(frozen=True)
class Dropout:
    """The dropout mode of one call: training (masks from `seed`) or evaluation (`dropout(e, p)` is e)."""

    train: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < SEED_LIMIT:  # pragma: no cover - made by `checked_seed`
            raise InputError(f"dropout_seed must be an integer in [0, 2**64), got {self.seed}")


EVAL = Dropout()


def checked_seed(seed: object) -> int:
    """A user's `dropout_seed` as an int in [0, 2^64), else an `InputError` saying what it got."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InputError(f"dropout_seed must be an integer in [0, 2**64), got {type(seed).__name__} {seed!r}")
    if not 0 <= int(seed) < SEED_LIMIT:
        raise InputError(f"dropout_seed must be an integer in [0, 2**64), got {int(seed)}")
    return int(seed)
