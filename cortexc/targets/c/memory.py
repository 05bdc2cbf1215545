"""The CPU executor's memory: how results, kept arrays and per-call scratch are allocated, and reused.

Three pools, each for one lifetime: results (`fresh_arrays`, `state_arrays`: the caller keeps them, so they
are fresh each call, but from one buffer), what a forward keeps for its backward (`Recycled`, `Kept`: given
back when the `Saved` that holds them is gone) and what the C code needs during one call only (`Scratch`,
per thread). The executor (`executor.py`) decides what goes where.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cortexc.runtime.abi import aligned_empty

if TYPE_CHECKING:
    from .executor import Saved


#: floats between the starts of two arrays of one `fresh_arrays` buffer are a multiple of this (64 bytes)
_ALIGN_FLOATS = 16


def fresh_arrays(shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Float32 arrays of these shapes, not zeroed, as views of one buffer. Why one: a forward's results are
    fresh memory each call (the caller keeps them), and fresh memory costs a page fault per 4 KiB on first
    write (a chain LSTM of 1000 x 10: 627 faults, ~1 ms of a 7 ms forward); numpy asks for transparent huge
    pages (madvise) for a buffer of 4 MiB or more, so one buffer for all of them takes ~20x fewer faults
    where several smaller ones each take theirs. Each array starts 64-byte aligned (the buffer does, and
    each start is a multiple of 16 floats into it)."""
    sizes = [math.prod(shape) for shape in shapes]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // _ALIGN_FLOATS) * _ALIGN_FLOATS
    flat = _empty(max(total, 1), np.float32)
    return [flat[start : start + size].reshape(shape) for start, size, shape in zip(starts, sizes, shapes)]


def state_arrays(n: int, shapes: Sequence[Sequence[int]], more: Sequence[Sequence[int]] = ()) -> list[np.ndarray]:
    """The state arrays of a forward: N + 1 rows, of which the C code writes rows 0..N-1 (every block of a
    cell assigns every state, and every node runs one), so only row N, the "missing child" row the kernels
    read for absent children, is zeroed here: no zero-fill of the N rows (~0.2 ms a call on 10k nodes).
    Then arrays of the shapes `more` (the outputs), all from one buffer (`fresh_arrays`)."""
    arrays = fresh_arrays([(n + 1, *shape) for shape in shapes] + [tuple(shape) for shape in more])
    for state in arrays[: len(shapes)]:
        state[n] = 0.0
    return arrays


#: how `state_arrays` and the scratch allocate (64-byte aligned; a test swaps in NaN-filled memory to show
#: that nothing else is read)
_empty = aligned_empty


class Scratch(threading.local):
    """Per-thread float32 buffers for arrays the C code needs only during one call (the hoisted rows of an
    inference; a backward's state gradients, hoisted rows' gradients and deferred factor rows; the zeroed
    tables of sparse embedding gradients). Why: a chain of 10k nodes needs ~10 MB of them per call, and fresh
    memory costs a page fault per 4 KiB (measured ~15% of a chain LSTM's training step); reused memory is
    already mapped. A thread keeps at most the largest size it has used, per slot. New memory comes from
    `_empty` (not zeroed: a test swaps in NaN-filled memory), so `zero` says whether the caller needs zeros."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int], np.ndarray] = {}
        self.tables: dict[str, np.ndarray] = {}

    def arrays(self, slot: str, shapes: Sequence[tuple[int, ...]], zero: bool) -> list[np.ndarray]:
        out = []
        for index, shape in enumerate(shapes):
            size = math.prod(shape)
            flat = self.slots.get((slot, index))
            if flat is None or flat.size < size:
                flat = _empty(max(size, 1), np.float32)
                self.slots[(slot, index)] = flat
            view = flat[:size].reshape(shape)
            if zero:
                view[...] = 0.0
            out.append(view)
        return out

    def zeroed_table(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A table that is all zeros whenever it is not lent out: the borrower zeroes again the rows it let
        the C code write, or `drop`s the table when it cannot tell which (a failed call)."""
        table = self.tables.get(name)
        if table is None or table.shape != shape:
            table = np.zeros(shape, np.float32)
            self.tables[name] = table
        return table

    def drop(self, name: str) -> None:
        self.tables.pop(name, None)


class Recycled:
    """The memory of what forwards kept for a backward (`Saved`: full states, hoisted rows, input copies),
    taken back once that `Saved` is gone and handed to the next such forward. Why: a training step's kept
    arrays (a 1000 x 10 chain LSTM: ~16 MB) would be fresh memory each step, and glibc gives a freed heap
    top that large back to the kernel, so every step page-faults it in again (measured: ~20% of the step).
    Buffers are flat 4-byte words viewed as the array's dtype (float32, int32). Shared by threads (a
    `Saved` may die on another thread, inside the garbage collector): deques, no lock. Keeps at most
    `KEEP` buffers per slot (one per kept array of a forward in flight), each of the size it was made."""

    KEEP = 2

    def __init__(self) -> None:
        self.free: dict[tuple[str, int], deque[np.ndarray]] = {}

    def take(self, slot: tuple[str, int], words: int) -> np.ndarray:
        pool = self.free.get(slot)
        while pool:
            try:
                flat = pool.pop()
            except IndexError:  # taken by another thread since the check
                break
            if flat.size >= words:
                return flat
        return _empty(max(words, 1), np.float32)

    def give(self, buffers: list[tuple[tuple[str, int], np.ndarray]]) -> None:
        for slot, flat in buffers:
            pool = self.free.setdefault(slot, deque())
            if len(pool) < self.KEEP:
                pool.append(flat)


class Kept:
    """The arrays one forward keeps for its backward, from `Recycled` memory: given back when the `Saved`
    that holds them is collected (nothing else holds them: the caller gets copies of the states)."""

    def __init__(self, recycled: Recycled) -> None:
        self.recycled = recycled
        self.buffers: list[tuple[tuple[str, int], np.ndarray]] = []

    def array(self, slot: tuple[str, int], shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype.itemsize != 4:  # pragma: no cover - the executor's arrays are float32 and int32
            return np.empty(shape, dtype)
        words = math.prod(shape)
        flat = self.recycled.take(slot, words)
        self.buffers.append((slot, flat))
        return flat[:words].view(dtype).reshape(shape)

    def states(self, n: int, shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """As `state_arrays`: rows 0..N-1 as the memory was (the C code writes them), row N zeroed."""
        states = []
        for index, shape in enumerate(shapes):
            state = self.array(("state", index), (n + 1, *shape))
            state[n] = 0.0
            states.append(state)
        return states

    def hold_until_gone(self, saved: Saved) -> None:
        finalizer = weakref.finalize(saved, self.recycled.give, self.buffers)
        finalizer.atexit = False  # nothing to give back at exit
