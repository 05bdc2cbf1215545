"""The CPU executor: one ctypes call into the generated library per forward.

It owns no model knowledge: it packs the weights the program names, lays
out the forest's arrays and the result arrays, fills `CxCall` (built, like the C
struct `cx_call`, from `abi.CALL_FIELDS`) and calls `cx_forward`.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from cortexc.errors import CortexcError
from cortexc.runtime.abi import CxCall, CxGrad, aligned_empty, packed_weights
from cortexc.runtime.build import load_library
from cortexc.runtime.linearize import Linearized
from cortexc.runtime.package import CellSpec
from cortexc.runtime.philox import EVAL, Dropout
from cortexc.targets.c import threads

if TYPE_CHECKING:
    from cortexc.runtime.executor import DeviceArrayCalls, HostArrayCalls

_P = ctypes.c_void_p


#: folding (`cortexc.passes.fold`: an inference reads folded look-up projections, not GEMMs): "0" turns it
#: off, "eager" builds the tables on the first inference after the params change; by default they are built
#: once the inferences since then have run as many rows as the tables have (building a table costs the GEMM
#: of all its rows: so the work spent unfolded is at most what the build costs, and a loop that runs one
#: inference per optimizer step never pays for a table it would use once)
FOLD_VARIABLE = "CORTEXC_FOLD"
#: the most memory the folded tables of one model may take, in MiB (a table that would pass it is not built)
FOLD_LIMIT_VARIABLE = "CORTEXC_FOLD_MAX_MB"
FOLD_LIMIT_MB = 256


def fold_limit_bytes() -> int:
    """`CORTEXC_FOLD_MAX_MB` (a non-negative number of MiB; 0 builds none) in bytes, else the default."""
    text = os.environ.get(FOLD_LIMIT_VARIABLE, "").strip()
    try:
        mib = float(text) if text else FOLD_LIMIT_MB
    except ValueError:
        mib = FOLD_LIMIT_MB
    return int(max(mib, 0.0) * 2**20)


def _pointers(arrays: Sequence[np.ndarray | None]) -> Any:
    """A C array of pointers (NULL for None); the caller keeps the arrays alive."""
    return (_P * max(len(arrays), 1))(*[None if array is None else array.ctypes.data for array in arrays])


#: floats between the starts of two arrays of one `_fresh_arrays` buffer are a multiple of this (64 bytes)
_ALIGN_FLOATS = 16


def _fresh_arrays(shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
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


def _state_arrays(n: int, shapes: Sequence[Sequence[int]], more: Sequence[Sequence[int]] = ()) -> list[np.ndarray]:
    """The state arrays of a forward: N + 1 rows, of which the C code writes rows 0..N-1 (every block of a
    cell assigns every state, and every node runs one), so only row N, the "missing child" row the kernels
    read for absent children, is zeroed here: no zero-fill of the N rows (~0.2 ms a call on 10k nodes).
    Then arrays of the shapes `more` (the outputs), all from one buffer (`_fresh_arrays`)."""
    arrays = _fresh_arrays([(n + 1, *shape) for shape in shapes] + [tuple(shape) for shape in more])
    for state in arrays[: len(shapes)]:
        state[n] = 0.0
    return arrays


#: how `_state_arrays` and the scratch allocate (64-byte aligned; a test swaps in NaN-filled memory to show
#: that nothing else is read)
_empty = aligned_empty


class Saved:
    """What a forward keeps for the backward: the full state arrays (with the zero row), hoisted rows (none
    where the backward reads none: `training_window`), the
    saved activations (the package's "saved" arrays, `[N, width]`: what the gradient kernels read instead of
    computing again) and the dropout mode (the backward recomputes the masks from it)."""

    def __init__(
        self,
        lin: Linearized,
        inputs: list[np.ndarray],
        states: list[np.ndarray],
        hoisted: list[np.ndarray],
        dropout: Dropout = EVAL,
        activations: list[np.ndarray] | None = None,
    ):
        self.dropout = dropout
        self.lin = lin
        self.inputs = inputs
        self.states = states
        self.hoisted = hoisted
        self.activations = activations or []


class _Scratch(threading.local):
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


class _Recycled:
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


class _Kept:
    """The arrays one forward keeps for its backward, from `_Recycled` memory: given back when the `Saved`
    that holds them is collected (nothing else holds them: the caller gets copies of the states)."""

    def __init__(self, recycled: _Recycled) -> None:
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
        """As `_state_arrays`: rows 0..N-1 as the memory was (the C code writes them), row N zeroed."""
        states = []
        for index, shape in enumerate(shapes):
            state = self.array(("state", index), (n + 1, *shape))
            state[n] = 0.0
            states.append(state)
        return states

    def hold_until_gone(self, saved: Saved) -> None:
        finalizer = weakref.finalize(saved, self.recycled.give, self.buffers)
        finalizer.atexit = False  # nothing to give back at exit


class CpuExecutor:
    """Runs one compiled cell. `spec` is the cell's entry of the package's `cell.json`; it reads the C target's
    section (`TARGET`)."""

    TARGET = "c"

    #: the calls on caller-allocated arrays (`run_forward`/`run_backward`) take host NumPy arrays
    on_device: Literal[False] = False
    #: `backward` takes `sparse_rows` (the model then asks for embedding gradients as rows only)
    sparse_backward = True
    #: which node kernel an inference runs where the package has a direct one (`cortexc.passes.direct`):
    #: 0 the driver's choice by the forest's level widths, 1 the hoisted kernel, 2 the direct (tests, A/Bs)
    direct = 0
    #: a backward's launches of fewer rows than this keep the narrow weight gradients' factor rows for the
    #: deferred phase (`cx_keeps_rows`): 0 the package's bound, 1 none (tests, A/Bs)
    keep_rows = 0

    def __init__(self, spec: CellSpec, library_path: Path):
        self.spec = spec
        self.section = spec.target(self.TARGET)
        threads.default_wait_policy()
        self.lib = load_library(library_path)
        self._declare_entry_points()
        # params and packed weights as one value, replaced whole: a call takes it once and keeps it alive, so
        # a `load_params` from another thread during a call (ctypes lets go of the GIL) neither mixes old and
        # new weights nor frees the ones the C code is reading
        self._weights: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        # the pointer tables of those weights, built once per set_params/repack: (params, packed, their tables),
        # one value; `_call` uses them only for these very lists (identity), so a replaced value is never read
        self._weight_tables: tuple[Any, ...] = (None, None, None, None)
        self._scratch = _Scratch()
        self._recycled = _Recycled()
        self._hoisted_set = self.section.hoisted_gradients_set
        # folded tables (`cortexc.passes.fold`): built by `cx_fold` from one `_weights` value on the first
        # inference that uses it, and paired with that value (compared by identity, held, so never reused)
        self.folding = True  # the model's switch (`CellModel(fold=False)`); CORTEXC_FOLD=0 overrides it
        self._folded: tuple[object, list[np.ndarray | None] | None, int] | None = None  # weights, tables, rows
        self._fold_lock = threading.Lock()
        self.fold_builds = 0  # how many times tables were built (and the time they took): for tests, benchmarks
        self.fold_build_seconds = 0.0

    def array_calls(self) -> HostArrayCalls | DeviceArrayCalls | None:
        """Itself: `run_forward`/`run_backward` on host arrays, with `repack` and the folded tables
        (`executor.HostArrayCalls`)."""
        return self

    def _declare_entry_points(self) -> None:
        self.lib.cx_forward.argtypes = [ctypes.POINTER(CxCall)]
        self.lib.cx_forward.restype = ctypes.c_int
        if hasattr(self.lib, "cx_backward"):
            self.lib.cx_backward.argtypes = [ctypes.POINTER(CxCall), ctypes.POINTER(CxGrad)]
            self.lib.cx_backward.restype = ctypes.c_int
        if hasattr(self.lib, "cx_set_num_threads"):
            self.lib.cx_set_num_threads.argtypes = [ctypes.c_int]
            self.lib.cx_set_num_threads.restype = None
        if hasattr(self.lib, "cx_call_threads"):
            self.lib.cx_call_threads.argtypes = [ctypes.POINTER(CxCall), ctypes.c_int]
            self.lib.cx_call_threads.restype = ctypes.c_int
        if hasattr(self.lib, "cx_fold"):
            self.lib.cx_fold.argtypes = [_P, _P, ctypes.c_int64, _P]
            self.lib.cx_fold.restype = ctypes.c_int

    def _set_threads(self) -> int:
        """Cap the library's threads: `CORTEXC_NUM_THREADS` and the CPUs other processes leave free (the
        library then takes its own choice per call below that and `OMP_NUM_THREADS`); the cap, 0 for none."""
        adapt = os.environ.get(threads.ADAPT_VARIABLE, "").strip() != "0"
        caps = [n for n in (threads.thread_cap(), threads.MACHINE.free_cpus() if adapt else 0) if n > 0]
        limit = min(caps) if caps else 0
        if hasattr(self.lib, "cx_set_num_threads"):
            self.lib.cx_set_num_threads(limit)
        return limit

    def call_threads(self, lin: Linearized, backward: bool = False) -> int:
        """The threads the compiled code runs a forward (or backward) of this forest on: its own choice from
        the forest's shape (`cx_call_threads`), under `OMP_NUM_THREADS` and `CORTEXC_NUM_THREADS`."""
        self._set_threads()
        call, _tables = self._call(lin, [], [], [], [], [], [])
        return int(self.lib.cx_call_threads(ctypes.byref(call), int(backward)))

    def hoisted_window_rows(self, lin: Linearized) -> int:
        """The rows of each hoisted array an inference needs: a window (see `cx_window_end` in the driver) of
        the package's `hoisted_window_rows`, or the widest level above the leaves if that is more, where that
        is fewer than the internal nodes; else one row per internal node."""
        internal = lin.num_nodes - lin.num_leaves
        window = self.section.hoisted_window_rows
        if not window or window >= internal:
            return internal
        return min(internal, max(window, lin.widest_internal_level))

    def _launch_forward(self, call: ctypes.Structure, lin: Linearized) -> None:
        limit = self._set_threads()
        status = self.lib.cx_forward(ctypes.byref(call))
        threads.MACHINE.ended(limit or threads.CPUS)
        if status == -2:
            raise CortexcError(f"the compiled forward was given {call.hoisted_rows} hoisted rows, fewer than a level")
        if status != 0:
            raise CortexcError("the compiled forward could not allocate its scratch memory")

    def _launch_backward(
        self, call: ctypes.Structure, grad: ctypes.Structure, lin: Linearized, upstream_mask: int
    ) -> None:
        limit = self._set_threads()
        failed = self.lib.cx_backward(ctypes.byref(call), ctypes.byref(grad)) != 0
        threads.MACHINE.ended(limit or threads.CPUS)
        if failed:
            raise CortexcError("the compiled backward could not allocate its scratch memory")

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Keep the params and pack the GEMM weights (stacked as the program says) once."""
        abi = self.spec.abi
        arrays = [np.ascontiguousarray(params[name], dtype=np.float32) for name in abi.params]
        self._keep_weights(arrays, packed_weights(self.lib, self.section.packed, params))

    @property
    def weights(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The params and packed weights of the last `set_params`/`repack`, as one value: what `folded_tables`
        takes, and what a caller keeps to run with them while another thread loads new ones."""
        return self._weights

    def forget_folded(self) -> None:
        """Drop the folded tables and their memory; the next inferences count rows again before a build."""
        self._folded = None

    def _keep_weights(self, params: list[np.ndarray], packed: list[np.ndarray]) -> None:
        """Store the weights and their pointer tables (tables first: a call that sees the new weights and the
        old tables only misses the fast path, it never reads the old tables for the new weights)."""
        self._weight_tables = (params, packed, _pointers(params), _pointers(packed))
        self._weights = (params, packed)
        self._folded = None  # of the old weights (kept from being served by the identity check anyway)

    def repack(self, params: Mapping[str, np.ndarray]) -> None:
        """Pack the GEMM weights again from these params (for callers that pass params per call, which
        `run_forward`/`run_backward` then read with these packed weights)."""
        self._keep_weights(self._weights[0], packed_weights(self.lib, self.section.packed, params))

    def folded_tables(
        self, weights: tuple[list[np.ndarray], list[np.ndarray]], rows: int = 0
    ) -> list[np.ndarray | None] | None:
        """The folded tables of these weights (a `_weights` value) for an inference of `rows` nodes, built
        when it pays (see `FOLD_VARIABLE`); None when the cell has no fold, folding is off (`folding`,
        `CORTEXC_FOLD=0`), not yet built or the memory cap leaves none. A table is None where the cap
        (`CORTEXC_FOLD_MAX_MB`, over all tables of the model) leaves it out."""
        folds = self.section.folds
        mode = os.environ.get(FOLD_VARIABLE, "").strip()
        if not folds or not self.folding or mode == "0" or not weights[1]:
            return None
        with self._fold_lock:  # two inferences from two threads build once
            cached = self._folded
            if cached is None or cached[0] is not weights:
                cached = (weights, None, 0)
            _, tables, seen = cached
            if tables is None:
                if mode != "eager" and seen + rows < sum(f.rows for f in folds):
                    self._folded = (weights, None, seen + rows)  # this one runs the GEMMs
                    return None
                tables = self._build_folds(weights)
            self._folded = (weights, tables, seen + rows)
        return tables if any(t is not None for t in tables) else None

    def _build_folds(self, weights: tuple[list[np.ndarray], list[np.ndarray]]) -> list[np.ndarray | None]:
        """Every fold's table `E @ W^T` by the library's `cx_fold` (the kernels' GEMM, bitwise theirs)."""
        params, packed = weights
        limit, total = fold_limit_bytes(), 0
        start = time.perf_counter()
        param_table, packed_table = _pointers(params), _pointers(packed)
        tables: list[np.ndarray | None] = []
        for index, fold in enumerate(self.section.folds):
            size = fold.rows * fold.m * 4
            if total + size > limit:
                tables.append(None)
                continue
            table = aligned_empty((fold.rows, fold.m))
            self._set_threads()
            if self.lib.cx_fold(ctypes.cast(param_table, _P), ctypes.cast(packed_table, _P), index, table.ctypes.data):
                raise CortexcError(f"the library has no fold {index} ({fold.name}): compile the package again")
            table.flags.writeable = False
            tables.append(table)
            total += size
        self.fold_builds += 1
        self.fold_build_seconds = time.perf_counter() - start
        return tables

    def _call(
        self,
        lin: Linearized,
        params: Sequence[np.ndarray],
        packed: Sequence[np.ndarray],
        input_arrays: Sequence[np.ndarray],
        states: Sequence[np.ndarray],
        hoisted: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        dropout: Dropout = EVAL,
        folded: Sequence[np.ndarray | None] | None = None,
        activations: Sequence[np.ndarray] | None = None,
    ) -> tuple[ctypes.Structure, list[Any]]:
        """The `cx_call` struct over these arrays, and what must outlive it (the pointer tables, the weights).
        The forest's addresses are read once per linearization (`Linearized.addresses`), the weights' tables
        once per `set_params`/`repack` (when these are the executor's own weights)."""
        level_order, level_ptr, edge_ptr, edge_child, roots = lin.addresses
        weight_tables = self._weight_tables
        if weight_tables[0] is params and weight_tables[1] is packed:
            params_table, packed_table = weight_tables[2], weight_tables[3]
        else:
            params_table, packed_table = _pointers(params), _pointers(packed)
        inputs_table, states_table = _pointers(input_arrays), _pointers(states)
        hoisted_table, outputs_table = _pointers(hoisted), _pointers(outputs)
        address = ctypes.addressof
        call = CxCall(
            num_nodes=lin.num_nodes,
            num_levels=lin.num_levels,
            max_children=lin.max_children,
            num_roots=len(lin.roots),
            level_order=level_order,
            level_ptr=level_ptr,
            edge_ptr=edge_ptr,
            edge_child=edge_child,
            roots=roots,
            params=address(params_table),
            packed=address(packed_table),
            inputs=address(inputs_table),
            states=address(states_table),
            hoisted=address(hoisted_table),
            outputs=address(outputs_table),
            dropout_seed=dropout.seed,
            dropout_train=int(dropout.train),
            hoisted_rows=min((len(array) for array in hoisted), default=0),
            direct=self.direct,
        )
        tables = [params_table, packed_table, inputs_table, states_table, hoisted_table, outputs_table]
        if folded is not None:  # else NULL: every GEMM runs
            folded_table = _pointers(folded)
            call.folded = address(folded_table)
            tables.append(folded_table)
        if activations is not None:  # else NULL: an inference (the kernels keep nothing)
            saved_table = _pointers(activations)
            call.saved = address(saved_table)
            tables.append(saved_table)
        return call, [*tables, params, packed, lin, folded]

    def run_forward(
        self,
        lin: Linearized,
        params: Sequence[np.ndarray],
        inputs: Sequence[np.ndarray],
        states: Sequence[np.ndarray],
        hoisted: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        packed: Sequence[np.ndarray] | None = None,
        dropout: Dropout = EVAL,
        folded: Sequence[np.ndarray | None] | None = None,
        activations: Sequence[np.ndarray] | None = None,
    ) -> None:
        """The forward into arrays the caller allocated (the ABI's orders and shapes: states with
        N + 1 rows, the last zero), with `packed` weights or those of the last `set_params`/`repack`.
        What `forward` does after allocating; `cortexc.torch` calls it with views of torch tensors.
        `folded`: tables of `folded_tables` made from these same params and packed weights (or None).
        `activations`: a forward a backward follows: the package's saved arrays (`saved_shapes`), which
        it fills and that backward reads (None: an inference)."""
        packed = self._weights[1] if packed is None else packed
        call, _tables = self._call(
            lin, params, packed, inputs, states, hoisted, outputs, dropout, folded, self._checked(lin, activations)
        )
        if lin.num_nodes:
            self._launch_forward(call, lin)

    def run_backward(
        self,
        lin: Linearized,
        params: Sequence[np.ndarray],
        inputs: Sequence[np.ndarray],
        states: Sequence[np.ndarray],
        hoisted: Sequence[np.ndarray],
        grads: Sequence[Sequence[np.ndarray | None]],
        packed: Sequence[np.ndarray] | None = None,
        dropout: Dropout = EVAL,
        activations: Sequence[np.ndarray] | None = None,
    ) -> None:
        """The backward into caller-allocated gradient arrays: `grads` is (d_params, d_inputs, d_states,
        d_hoisted, upstream_outputs) as `cx_grad` orders them (zeroed, d_states holding the upstream
        gradients of the states; None for index inputs and for outputs without an upstream). The deferred
        weight gradients' factor rows (`deferred_shapes`) are this thread's scratch unless a sixth entry
        gives them. `activations`: what the forward saved (`run_forward`), needed when the package saves any."""
        outputs = [np.empty(0, np.float32) for _ in self.spec.abi.outputs]
        packed = self._weights[1] if packed is None else packed
        call, _tables = self._call(
            lin, params, packed, inputs, states, hoisted, outputs, dropout, None, self._checked(lin, activations, True)
        )
        if len(grads) == 5:
            # not zeroed: a kernel writes every row of its terms, and the driver skips the terms of a kernel
            # that did not run (an output without an upstream gradient)
            grads = (*grads, self._scratch.arrays("deferred", self.deferred_shapes(lin), zero=False))
        grad_tables = [_pointers(list(arrays)) for arrays in grads]
        grad = CxGrad(*(ctypes.cast(table, _P) for table in grad_tables), self.keep_rows)
        if lin.num_nodes:
            mask = sum(1 << index for index, array in enumerate(grads[4]) if array is not None)
            self._launch_backward(call, grad, lin, mask)

    def saved_shapes(self, lin: Linearized) -> list[tuple[int, int]]:
        """The shapes of the arrays a forward a backward follows keeps for it (`passes.saving`): a row of
        each saved array's width per internal node, or per leaf, in level order (every row is written)."""
        internal = lin.num_nodes - lin.num_leaves
        return [(internal if values.internal else lin.num_leaves, values.width) for values in self.section.saved]

    def _checked(
        self, lin: Linearized, activations: Sequence[np.ndarray] | None, needed: bool = False
    ) -> Sequence[np.ndarray] | None:
        """`activations` if they fit this package and forest (the kernels write and read them unchecked);
        `needed`: a backward, which reads them when the package saves any."""
        shapes = self.saved_shapes(lin)
        if activations is None:
            if needed and shapes:
                raise CortexcError("this package's backward reads what its forward saved: pass its activations")
            return None
        if len(activations) != len(shapes) or any(
            a.shape != shape or a.dtype != np.float32 or not a.flags.c_contiguous
            for a, shape in zip(activations, shapes)
        ):
            got = [(a.shape, str(a.dtype)) for a in activations]
            raise CortexcError(f"saved activations {got} do not fit this package's {shapes} (float32, contiguous)")
        return activations

    def deferred_shapes(self, lin: Linearized) -> list[tuple[int, int]]:
        """The shapes of the deferred weight gradients' factor rows a backward needs (one row per node
        position, or per child edge, of m + k floats)."""
        edges = int(lin.edge_ptr[-1]) if len(lin.edge_ptr) else 0
        return [
            (max(edges if term.rows == "child" else lin.num_nodes, 1), term.m + term.k)
            for term in self.section.deferred
        ]

    def forward(
        self,
        lin: Linearized,
        inputs: Mapping[str, np.ndarray],
        keep: bool = False,
        host: bool = True,
        dropout: Dropout = EVAL,
    ) -> tuple[dict[str, np.ndarray], Saved | None]:
        """States and outputs; with `keep`, also what `backward` needs. (`host`: the results are in host
        memory here anyway.)"""
        abi = self.spec.abi
        n = lin.num_nodes
        internal = n - lin.num_leaves
        widths = self.spec.hoisted_widths
        kept = _Kept(self._recycled) if keep else None
        state_shapes = [s.shape for s in self.spec.signature.states]
        output_shapes = [(len(lin.roots) if o.at_root else n, *o.shape) for o in self.spec.signature.outputs]
        copies_of_states: list[np.ndarray] = []
        # a training forward whose backward reads no hoisted row computes them a window at a time, as an inference
        windowed = kept is None or self.section.training_window
        if kept is not None:  # kept for the backward: arrays of its own (recycled memory, see `_Recycled`)
            states = kept.states(n, state_shapes)
            # the caller's: copies of the states and the outputs, from one fresh buffer (see `_fresh_arrays`)
            fresh = _fresh_arrays([(n, *shape) for shape in state_shapes] + output_shapes)
            copies_of_states, outputs = fresh[: len(state_shapes)], fresh[len(state_shapes) :]
        else:  # the caller's: the states and the outputs, from one fresh buffer
            arrays = _state_arrays(n, state_shapes, output_shapes)
            states, outputs = arrays[: len(state_shapes)], arrays[len(state_shapes) :]
        if windowed or kept is None:  # this thread's scratch, reused by its next call: a backward gets none
            rows = self.hoisted_window_rows(lin)
            hoisted = self._scratch.arrays("hoisted", [(rows, width) for width in widths], zero=False)
        else:  # every row, kept for the backward
            hoisted = [kept.array(("hoisted", i), (internal, width)) for i, width in enumerate(widths)]
        # kept for a backward: the inputs are copied (they may be the caller's arrays) and the states returned
        # as copies, so editing either afterwards cannot change the gradients (one copy of each, O(N * width))
        input_arrays = [inputs[name] for name in abi.inputs]
        if kept is not None:
            copies = []
            for index, array in enumerate(input_arrays):
                copy = kept.array(("input", index), array.shape, array.dtype)
                np.copyto(copy, array)
                copies.append(copy)
            input_arrays = copies
        weights = self._weights  # one value: a concurrent load_params neither mixes nor frees them
        params, packed = weights
        folded = None if kept is not None else self.folded_tables(weights, n)  # a kept forward never folds
        activations = None
        if kept is not None:  # what the backward reads instead of computing again (rows the kernels write)
            activations = [kept.array(("saved", i), shape) for i, shape in enumerate(self.saved_shapes(lin))]
        self.run_forward(lin, params, input_arrays, states, hoisted, outputs, packed, dropout, folded, activations)
        for copy, state in zip(copies_of_states, states):
            np.copyto(copy, state[:n])
        result = {name: state[:n] for name, state in zip(abi.states, copies_of_states or states)}
        result.update(zip(abi.outputs, outputs))
        if kept is None:
            return result, None
        saved = Saved(lin, input_arrays, states, [] if windowed else hoisted, dropout, activations)
        kept.hold_until_gone(saved)
        return result, saved

    def backward(
        self,
        saved: Saved,
        upstream: Mapping[str, np.ndarray],
        param_shapes: Mapping[str, tuple[int, ...]],
        sparse_rows: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Gradients of every param and float input from upstream gradients of states and outputs.

        The gradients returned are fresh arrays the caller owns; the work arrays are this thread's scratch
        (`_Scratch`: no fresh pages per step). `sparse_rows` maps a param used only as an embedding table
        to the rows the forest looks up (unique): its gradient is then only those rows, `[len(rows), ...]`,
        computed in a table kept zeroed between calls (so no step zeroes or allocates the whole table)."""
        abi = self.spec.abi
        lin = saved.lin
        n = lin.num_nodes
        sparse_rows = sparse_rows or {}
        # the params' gradients are summed into (zeros needed); the ones returned are the caller's own
        d_params = [
            self._scratch.zeroed_table(name, tuple(param_shapes[name]))
            if name in sparse_rows
            else np.zeros(param_shapes[name], np.float32)
            for name in abi.params
        ]
        index_inputs = {i.name for i in self.spec.signature.inputs if i.is_index}
        d_inputs = [  # added into (StoreMode.ADD) and returned: zeros of the caller's own
            None if name in index_inputs else np.zeros(array.shape, np.float32)
            for name, array in zip(abi.inputs, saved.inputs)
        ]
        # the states' gradients are added into, row N included (an absent child's): each starts at its
        # upstream or zero; scratch, not returned
        d_states = self._scratch.arrays("d_states", [state.shape for state in saved.states], zero=False)
        for name, d_state in zip(abi.states, d_states):
            if name in upstream:
                d_state[:n] = upstream[name]
                d_state[n:] = 0.0
            else:
                d_state[...] = 0.0
        # the hoisted rows' gradients: not zeroed where the node gradient kernel SETs them (every internal
        # row, before the hoisted projections' backward reads them); zeroed where it stores none
        internal = n - lin.num_leaves
        d_hoisted = [
            self._scratch.arrays(f"d_hoisted{index}", [(internal, width)], zero=not is_set)[0]
            for index, (width, is_set) in enumerate(zip(self.spec.hoisted_widths, self._hoisted_set))
        ]
        upstream_outputs = [
            None if name not in upstream else np.ascontiguousarray(upstream[name], np.float32) for name in abi.outputs
        ]
        grads = (d_params, d_inputs, d_states, d_hoisted, upstream_outputs)
        params, packed = self._weights
        # none kept (`training_window`): empty arrays, one per hoisted array, that the gradient kernels never read
        hoisted = saved.hoisted or [np.empty((0, width), np.float32) for width in self.spec.hoisted_widths]
        try:
            self.run_backward(
                lin, params, saved.inputs, saved.states, hoisted, grads, packed, saved.dropout, saved.activations
            )
        except BaseException:
            for name in sparse_rows:  # written somewhere: not known to be zero any more
                self._scratch.drop(name)
            raise
        result = dict(zip(abi.params, d_params))
        for name, rows in sparse_rows.items():
            table = result[name]
            result[name] = table[rows]  # a copy of the rows (the caller's own)
            table[rows] = 0.0  # the only rows the look-ups wrote: the table is all zeros again
        result.update((name, d) for name, d in zip(abi.inputs, d_inputs) if d is not None)
        return result
