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
from typing import Any

import numpy as np

from cortexc.errors import CortexcError
from cortexc.runtime.abi import CxCall, CxGrad, packed_weights
from cortexc.runtime.build import load_library
from cortexc.runtime.linearize import Linearized
from cortexc.runtime.philox import EVAL, Dropout

_P = ctypes.c_void_p

#: the cortexc setting that caps the threads of the compiled CPU code (below `OMP_NUM_THREADS`)
THREADS_VARIABLE = "CORTEXC_NUM_THREADS"
#: libgomp's spin count before a waiting thread sleeps, when the user sets no wait policy: its default
#: (300000 spins, ~1 ms) makes every barrier cost a time slice when another process takes a core
SPIN_COUNT = "10000"


def _default_wait_policy() -> None:
    """Bounded spinning at OpenMP barriers unless the user chose a policy (read when libgomp loads)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def thread_cap() -> int:
    """`CORTEXC_NUM_THREADS` as a positive int, or 0 (no cap of ours) when unset or not a positive int."""
    text = os.environ.get(THREADS_VARIABLE, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else 0


#: "0" turns off the cap by other processes' load below (for measurements and tests of exact thread counts)
ADAPT_VARIABLE = "CORTEXC_ADAPT_THREADS"
#: where Linux shows how many threads are runnable right now (the 4th field of /proc/loadavg: "runnable/total")
LOADAVG = "/proc/loadavg"
#: how long the OpenMP workers of a call may still spin after it (GOMP_SPINCOUNT spins), runnable but ours
SPIN_WINDOW_S = 0.002


def runnable_others(loadavg: bytes, own_spinning: int) -> int | None:
    """Threads runnable besides the caller and `own_spinning` workers of ours, from /proc/loadavg's text
    (None when it does not read as Linux writes it)."""
    fields = loadavg.split()
    if len(fields) < 4 or not fields[3].split(b"/")[0].isdigit():
        return None
    return max(0, int(fields[3].split(b"/")[0]) - 1 - own_spinning)


class _Machine:
    """Whether other processes take cores now: a call runs on at most the CPUs the others leave free, so a
    busy neighbour turns a call to one thread instead of making every level barrier wait a time slice for
    a thread that has no core. Read per call (one pread of /proc/loadavg, ~1 us); where that file does not
    exist nothing is capped. A worker of our previous call still spinning counts as ours, not as load."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.opened = False
        self.last_end = 0.0
        self.last_threads = 1

    def free_cpus(self) -> int:
        """CPUs not taken by other runnable threads (at least 1), or 0 when unknown."""
        if not self.opened:
            self.opened = True
            try:
                self.fd = os.open(LOADAVG, os.O_RDONLY)
            except OSError:
                self.fd = None
        if self.fd is None:
            return 0
        try:
            text = os.pread(self.fd, 128, 0)
        except OSError:
            return 0
        spinning = self.last_threads - 1 if time.monotonic() - self.last_end < SPIN_WINDOW_S else 0
        others = runnable_others(text, spinning)
        return 0 if others is None else max(1, (os.cpu_count() or 1) - others)

    def ended(self, threads: int) -> None:
        self.last_end, self.last_threads = time.monotonic(), max(threads, 1)


MACHINE = _Machine()

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
    table = (_P * max(len(arrays), 1))()
    for index, array in enumerate(arrays):
        table[index] = None if array is None else array.ctypes.data
    return table


class Saved:
    """What a forward keeps for the backward: the full state arrays (with the zero row), hoisted rows and the
    dropout mode (the backward recomputes the masks from it)."""

    def __init__(
        self,
        lin: Linearized,
        inputs: list[np.ndarray],
        states: list[np.ndarray],
        hoisted: list[np.ndarray],
        dropout: Dropout = EVAL,
    ):
        self.dropout = dropout
        self.lin = lin
        self.inputs = inputs
        self.states = states
        self.hoisted = hoisted


class _Scratch(threading.local):
    """Per-thread float32 buffers for arrays the C code needs only during one call (the hoisted rows of an
    inference, the hoisted rows' gradients of a backward). Why: a chain of 10k nodes needs ~10 MB of them per
    call, and fresh memory costs a page fault per 4 KiB (measured ~15% of a chain LSTM's training step);
    reused memory is already mapped. A thread keeps at most the largest size it has used, per slot."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int], np.ndarray] = {}

    def arrays(self, slot: str, shapes: Sequence[tuple[int, int]], zero: bool) -> list[np.ndarray]:
        out = []
        for index, (rows, width) in enumerate(shapes):
            size = rows * width
            flat = self.slots.get((slot, index))
            if flat is None or flat.size < size:
                flat = np.zeros(max(size, 1), np.float32)
                self.slots[(slot, index)] = flat
            elif zero:
                flat[:size] = 0.0
            out.append(flat[:size].reshape(rows, width))
        return out


class CpuExecutor:
    """Runs one compiled cell. `spec` is the cell's entry of the generated JSON."""

    def __init__(self, spec: Mapping[str, Any], library_path: Path):
        self.spec = spec
        _default_wait_policy()
        self.lib = load_library(library_path)
        self._declare_entry_points()
        # params and packed weights as one value, replaced whole: a call takes it once and keeps it alive, so
        # a `load_params` from another thread during a call (ctypes lets go of the GIL) neither mixes old and
        # new weights nor frees the ones the C code is reading
        self._weights: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        self._scratch = _Scratch()
        # folded tables (`cortexc.passes.fold`): built by `cx_fold` from one `_weights` value on the first
        # inference that uses it, and paired with that value (compared by identity, held, so never reused)
        self.folding = True  # the model's switch (`CellModel(fold=False)`); CORTEXC_FOLD=0 overrides it
        self._folded: tuple[object, list[np.ndarray | None] | None, int] | None = None  # weights, tables, rows
        self._fold_lock = threading.Lock()
        self.fold_builds = 0  # how many times tables were built (and the time they took): for tests, benchmarks
        self.fold_build_seconds = 0.0

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
        adapt = os.environ.get(ADAPT_VARIABLE, "").strip() != "0"
        caps = [n for n in (thread_cap(), MACHINE.free_cpus() if adapt else 0) if n > 0]
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

    def _launch_forward(self, call: ctypes.Structure, lin: Linearized) -> None:
        limit = self._set_threads()
        failed = self.lib.cx_forward(ctypes.byref(call)) != 0
        MACHINE.ended(limit or (os.cpu_count() or 1))
        if failed:
            raise CortexcError("the compiled forward could not allocate its scratch memory")

    def _launch_backward(
        self, call: ctypes.Structure, grad: ctypes.Structure, lin: Linearized, upstream_mask: int
    ) -> None:
        limit = self._set_threads()
        failed = self.lib.cx_backward(ctypes.byref(call), ctypes.byref(grad)) != 0
        MACHINE.ended(limit or (os.cpu_count() or 1))
        if failed:
            raise CortexcError("the compiled backward could not allocate its scratch memory")

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Keep the params and pack the GEMM weights (stacked as the program says) once."""
        abi = self.spec["abi"]
        arrays = [np.ascontiguousarray(params[name], dtype=np.float32) for name in abi["params"]]
        self._weights = (arrays, packed_weights(self.lib, self.spec, params))
        self._folded = None  # of the old weights (kept from being served by the identity check anyway)

    def repack(self, params: Mapping[str, np.ndarray]) -> None:
        """Pack the GEMM weights again from these params (for callers that pass params per call, which
        `run_forward`/`run_backward` then read with these packed weights)."""
        self._weights = (self._weights[0], packed_weights(self.lib, self.spec, params))
        self._folded = None

    def folded_tables(
        self, weights: tuple[list[np.ndarray], list[np.ndarray]], rows: int = 0
    ) -> list[np.ndarray | None] | None:
        """The folded tables of these weights (a `_weights` value) for an inference of `rows` nodes, built
        when it pays (see `FOLD_VARIABLE`); None when the cell has no fold, folding is off (`folding`,
        `CORTEXC_FOLD=0`), not yet built or the memory cap leaves none. A table is None where the cap
        (`CORTEXC_FOLD_MAX_MB`, over all tables of the model) leaves it out."""
        folds = self.spec.get("folds") or []
        mode = os.environ.get(FOLD_VARIABLE, "").strip()
        if not folds or not self.folding or mode == "0" or not weights[1]:
            return None
        with self._fold_lock:  # two inferences from two threads build once
            cached = self._folded
            if cached is None or cached[0] is not weights:
                cached = (weights, None, 0)
            _, tables, seen = cached
            if tables is None:
                if mode != "eager" and seen + rows < sum(f["rows"] for f in folds):
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
        for index, fold in enumerate(self.spec["folds"]):
            size = fold["rows"] * fold["m"] * 4
            if total + size > limit:
                tables.append(None)
                continue
            table = np.empty((fold["rows"], fold["m"]), np.float32)
            self._set_threads()
            if self.lib.cx_fold(ctypes.cast(param_table, _P), ctypes.cast(packed_table, _P), index, table.ctypes.data):
                raise CortexcError(f"the library has no fold {index} ({fold['name']}): compile the package again")
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
    ) -> tuple[ctypes.Structure, list[Any]]:
        """The `cx_call` struct over these arrays, and what must outlive it (the pointer tables, the weights)."""
        call = CxCall(
            num_nodes=lin.num_nodes,
            num_levels=lin.num_levels,
            max_children=lin.max_children,
            num_roots=len(lin.roots),
            level_order=lin.level_order.ctypes.data,
            level_ptr=lin.level_ptr.ctypes.data,
            edge_ptr=lin.edge_ptr.ctypes.data,
            edge_child=lin.edge_child.ctypes.data,
            roots=lin.roots.ctypes.data,
            dropout_seed=dropout.seed,
            dropout_train=int(dropout.train),
        )
        tables = {
            "params": _pointers(params),
            "packed": _pointers(packed),
            "inputs": _pointers(input_arrays),
            "states": _pointers(states),
            "hoisted": _pointers(hoisted),
            "outputs": _pointers(outputs),
        }
        if folded is not None:  # else NULL: every GEMM runs
            tables["folded"] = _pointers(folded)
        for field, table in tables.items():
            setattr(call, field, ctypes.cast(table, _P))
        return call, [*tables.values(), params, packed, folded]

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
    ) -> None:
        """The forward into arrays the caller allocated (the ABI's orders and shapes: states with
        N + 1 rows, the last zero), with `packed` weights or those of the last `set_params`/`repack`.
        What `forward` does after allocating; `cortexc.torch` calls it with views of torch tensors.
        `folded`: tables of `folded_tables` made from these same params and packed weights (or None)."""
        packed = self._weights[1] if packed is None else packed
        call, _tables = self._call(lin, params, packed, inputs, states, hoisted, outputs, dropout, folded)
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
    ) -> None:
        """The backward into caller-allocated gradient arrays: `grads` is (d_params, d_inputs, d_states,
        d_hoisted, upstream_outputs) as `cx_grad` orders them (zeroed, d_states holding the upstream
        gradients of the states; None for index inputs and for outputs without an upstream)."""
        outputs = [np.empty(0, np.float32) for _ in self.spec["abi"]["outputs"]]
        packed = self._weights[1] if packed is None else packed
        call, _tables = self._call(lin, params, packed, inputs, states, hoisted, outputs, dropout)
        grad_tables = [_pointers(list(arrays)) for arrays in grads]
        grad = CxGrad(*(ctypes.cast(table, _P) for table in grad_tables))
        if lin.num_nodes:
            mask = sum(1 << index for index, array in enumerate(grads[4]) if array is not None)
            self._launch_backward(call, grad, lin, mask)

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
        abi = self.spec["abi"]
        n = lin.num_nodes
        states = [np.zeros((n + 1, *shape), np.float32) for shape in self.spec["state_shapes"]]
        internal = n - lin.num_leaves
        widths = self.spec["hoisted_widths"]
        if keep:  # kept for the backward: its own arrays
            hoisted = [np.empty((internal, width), np.float32) for width in widths]
        else:
            hoisted = self._scratch.arrays("hoisted", [(internal, width) for width in widths], zero=False)
        outputs = []
        for out in self.spec["outputs"]:
            rows = len(lin.roots) if out["at_root"] else n
            outputs.append(np.empty((rows, *out["shape"]), np.float32))
        # kept for a backward: the inputs are copied (they may be the caller's arrays) and the states returned
        # as copies, so editing either afterwards cannot change the gradients (one copy of each, O(N * width))
        input_arrays = [inputs[name].copy() if keep else inputs[name] for name in abi["inputs"]]
        weights = self._weights  # one value: a concurrent load_params neither mixes nor frees them
        params, packed = weights
        folded = None if keep else self.folded_tables(weights, n)  # a forward kept for a backward never folds
        self.run_forward(lin, params, input_arrays, states, hoisted, outputs, packed, dropout, folded)
        result = {name: state[:n].copy() if keep else state[:n] for name, state in zip(abi["states"], states)}
        result.update(zip(abi["outputs"], outputs))
        return result, (Saved(lin, input_arrays, states, hoisted, dropout) if keep else None)

    def backward(
        self, saved: Saved, upstream: Mapping[str, np.ndarray], param_shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, np.ndarray]:
        """Gradients of every param and float input from upstream gradients of states and outputs."""
        abi = self.spec["abi"]
        lin = saved.lin
        n = lin.num_nodes
        d_params = [np.zeros(param_shapes[name], np.float32) for name in abi["params"]]
        input_specs = {i["name"]: i for i in self.spec["inputs"]}
        d_inputs = [
            None if input_specs[name]["dtype"] == "int32" else np.zeros_like(array)
            for name, array in zip(abi["inputs"], saved.inputs)
        ]
        d_states = []
        for name, state in zip(abi["states"], saved.states):
            d_state = np.zeros_like(state)
            if name in upstream:
                d_state[:n] = upstream[name]
            d_states.append(d_state)
        d_hoisted = self._scratch.arrays("d_hoisted", [h.shape for h in saved.hoisted], zero=True)
        upstream_outputs = [
            None if name not in upstream else np.ascontiguousarray(upstream[name], np.float32)
            for name in abi["outputs"]
        ]
        grads = (d_params, d_inputs, d_states, d_hoisted, upstream_outputs)
        params, packed = self._weights
        self.run_backward(lin, params, saved.inputs, saved.states, saved.hoisted, grads, packed, saved.dropout)
        result = dict(zip(abi["params"], d_params))
        result.update((name, d) for name, d in zip(abi["inputs"], d_inputs) if d is not None)
        return result
