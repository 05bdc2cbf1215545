"""The CPU executor: one ctypes call into the generated library per forward.

It owns no model knowledge: it packs the weights the program names, lays
out the forest's arrays and the result arrays, fills `CxCall` (the C struct
`cx_call` of the template, field for field) and calls `cx_forward`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cortexc.errors import CortexcError
from cortexc.runtime.build import load_library
from cortexc.runtime.linearize import Linearized

_P = ctypes.c_void_p


class CxCall(ctypes.Structure):
    _fields_ = [
        ("num_nodes", ctypes.c_int64),
        ("num_levels", ctypes.c_int64),
        ("max_children", ctypes.c_int64),
        ("num_roots", ctypes.c_int64),
        ("level_order", _P),
        ("level_ptr", _P),
        ("edge_ptr", _P),
        ("edge_child", _P),
        ("roots", _P),
        ("params", _P),
        ("packed", _P),
        ("inputs", _P),
        ("states", _P),
        ("hoisted", _P),
        ("outputs", _P),
    ]


def _pointers(arrays: list[np.ndarray]) -> Any:
    table = (_P * max(len(arrays), 1))()
    for index, array in enumerate(arrays):
        table[index] = array.ctypes.data
    return table


class CpuExecutor:
    """Runs one compiled cell. `spec` is the cell's entry of the generated JSON."""

    def __init__(self, spec: Mapping[str, Any], library_path: Path):
        self.spec = spec
        self.lib = load_library(library_path)
        self.lib.cx_forward.argtypes = [ctypes.POINTER(CxCall)]
        self.lib.cx_forward.restype = ctypes.c_int
        self.lib.cx_packed_floats.argtypes = [ctypes.c_int, ctypes.c_int]
        self.lib.cx_packed_floats.restype = ctypes.c_int64
        self.lib.cx_pack_weight.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P]
        self.lib.cx_pack_weight.restype = None
        self._params: list[np.ndarray] = []
        self._packed: list[np.ndarray] = []

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Keep the params and pack the GEMM weights (stacked as the program says) once."""
        abi = self.spec["abi"]
        self._params = [np.ascontiguousarray(params[name], dtype=np.float32) for name in abi["params"]]
        self._packed = []
        for weight in self.spec["packed"]:
            stacked = np.ascontiguousarray(np.concatenate([params[p] for p in weight["params"]], axis=0),
                                           dtype=np.float32)
            packed = np.empty(self.lib.cx_packed_floats(weight["m"], weight["k"]), dtype=np.float32)
            self.lib.cx_pack_weight(stacked.ctypes.data, weight["m"], weight["k"], packed.ctypes.data)
            self._packed.append(packed)

    def forward(self, lin: Linearized, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        abi = self.spec["abi"]
        n = lin.num_nodes
        states = [np.zeros((n + 1, *shape), np.float32) for shape in self.spec["state_shapes"]]
        internal = n - lin.num_leaves
        hoisted = [np.empty((internal, width), np.float32) for width in self.spec["hoisted_widths"]]
        outputs = []
        for out in self.spec["outputs"]:
            rows = len(lin.roots) if out["at_root"] else n
            outputs.append(np.empty((rows, *out["shape"]), np.float32))
        input_arrays = [inputs[name] for name in abi["inputs"]]
        call = CxCall(
            num_nodes=n,
            num_levels=lin.num_levels,
            max_children=lin.max_children,
            num_roots=len(lin.roots),
            level_order=lin.level_order.ctypes.data,
            level_ptr=lin.level_ptr.ctypes.data,
            edge_ptr=lin.edge_ptr.ctypes.data,
            edge_child=lin.edge_child.ctypes.data,
            roots=lin.roots.ctypes.data,
        )
        tables = {
            "params": _pointers(self._params),
            "packed": _pointers(self._packed),
            "inputs": _pointers(input_arrays),
            "states": _pointers(states),
            "hoisted": _pointers(hoisted),
            "outputs": _pointers(outputs),
        }
        for field, table in tables.items():
            setattr(call, field, ctypes.cast(table, _P))
        if n:
            status = self.lib.cx_forward(ctypes.byref(call))
            if status != 0:
                raise CortexcError("the compiled forward could not allocate its scratch memory")
        result = {name: state[:n] for name, state in zip(abi["states"], states)}
        result.update(zip(abi["outputs"], outputs))
        return result
