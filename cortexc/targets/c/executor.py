"""The CPU executor: one ctypes call into the generated library per forward.

It owns no model knowledge: it packs the weights the program names, lays
out the forest's arrays and the result arrays, fills `CxCall` (built, like the C
struct `cx_call`, from `abi.CALL_FIELDS`) and calls `cx_forward`.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
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

from . import threads
from .memory import Kept, Recycled, Scratch, fresh_arrays, state_arrays

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
    #: deferred phase (`cx_narrow_launch`): 0 the package's bound, 1 none (tests, A/Bs)
    narrow_rows = 0

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
        self._scratch = Scratch()
        self._recycled = Recycled()
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
            step_nodes=lin.step_nodes,
            state_rows=lin.state_rows,
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
        grad = CxGrad(*(ctypes.cast(table, _P) for table in grad_tables), self.narrow_rows)
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
        kept = Kept(self._recycled) if keep else None
        state_shapes = [s.shape for s in self.spec.signature.states]
        output_shapes = [(len(lin.roots) if o.at_root else n, *o.shape) for o in self.spec.signature.outputs]
        copies_of_states: list[np.ndarray] = []
        # a training forward whose backward reads no hoisted row computes them a window at a time, as an inference
        windowed = kept is None or self.section.training_window
        if kept is not None:  # kept for the backward: arrays of its own (recycled memory, see `Recycled`)
            states = kept.states(n, state_shapes)
            # the caller's: copies of the states and the outputs, from one fresh buffer (see `fresh_arrays`)
            fresh = fresh_arrays([(n, *shape) for shape in state_shapes] + output_shapes)
            copies_of_states, outputs = fresh[: len(state_shapes)], fresh[len(state_shapes) :]
        else:  # the caller's: the states and the outputs, from one fresh buffer
            arrays = state_arrays(lin.state_rows, state_shapes, output_shapes)  # a graph inference's: 2 steps
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
        rows = lin.state_rows  # n but in a graph cell's inference (its two steps' rows)
        result = {name: state[:rows] for name, state in zip(abi.states, copies_of_states or states)}
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
        (`Scratch`: no fresh pages per step). `sparse_rows` maps a param used only as an embedding table
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
