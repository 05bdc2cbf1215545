"""The CUDA executor (``device="cuda"``): PyCUDA for device memory, the generated `.cu` for the launches.

The `.cu` carries its own host launch sequence (the level loop, one grid per
kernel and level; see `templates/driver_cuda.j2`), compiled by nvcc into a
shared library and called through ctypes with the same `cx_call`/`cx_grad`
structs as the CPU executor, filled with device pointers from PyCUDA
allocations. PyCUDA makes the context current; the CUDA runtime inside the
library uses that context. Params are uploaded once (`set_params`), forest
arrays on every call. The CPU emulation (`cuda_emulated.py`) runs the same
source and host code in CI; what only a GPU exercises is this file.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np

from cortexc.errors import CortexcError
from cortexc.runtime.build import build_shared, load_library
from cortexc.runtime.cpu import CxCall, CxGrad, packed_weights
from cortexc.runtime.linearize import Linearized

INSTALL_HINT = "install cortexc[cuda] on a machine with an NVIDIA driver"


def _pycuda():
    """PyCUDA's driver and gpuarray modules, with a context; a clear error where they cannot be had."""
    try:
        import pycuda.autoinit  # noqa: F401  (creates the context)
        import pycuda.driver as driver
        import pycuda.gpuarray as gpuarray
    except ImportError as err:
        raise CortexcError(f"device='cuda' needs PyCUDA ({err}): {INSTALL_HINT}") from None
    except Exception as err:  # pycuda raises its own error types when there is no driver or device
        raise CortexcError(f"device='cuda' found no usable GPU ({err}): {INSTALL_HINT}") from None
    return driver, gpuarray


class CudaExecutor:
    """Runs one compiled cell on the GPU. `spec` is the cell's entry of the generated JSON."""

    def __init__(self, spec: Mapping[str, Any], cuda_source: str, name: str):
        self.driver, self.gpuarray = _pycuda()
        major, minor = self.driver.Context.get_device().compute_capability()
        flags = ("-x", "cu", "-O3", "-shared", "-Xcompiler", "-fPIC", f"-arch=sm_{major}{minor}")  # a .cu, named .c
        self.lib = load_library(build_shared(cuda_source, f"{name}_sm{major}{minor}", compiler="nvcc", flags=flags))
        self.lib.cx_forward.argtypes = [ctypes.POINTER(CxCall), ctypes.c_void_p]
        self.lib.cx_forward.restype = ctypes.c_int
        self.lib.cx_backward.argtypes = [ctypes.POINTER(CxCall), ctypes.POINTER(CxGrad), ctypes.c_void_p,
                                         ctypes.c_int64]
        self.lib.cx_backward.restype = ctypes.c_int
        self.spec = spec
        self._params: list[Any] = []
        self._packed: list[Any] = []

    # --- device memory ----------------------------------------------------------
    def _up(self, array: np.ndarray):
        return self.gpuarray.to_gpu(np.ascontiguousarray(array))

    def _table(self, arrays: list[Any]):
        """A device array of device pointers (0 for None)."""
        pointers = np.array([0 if a is None else int(a.gpudata) for a in arrays] or [0], dtype=np.uint64)
        return self._up(pointers)

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        abi = self.spec["abi"]
        self._params = [self._up(np.asarray(params[name], np.float32)) for name in abi["params"]]
        self._packed = [self._up(packed) for packed in packed_weights(self.lib, self.spec, params)]

    def _call(self, lin: Linearized, device: dict[str, Any]) -> tuple[CxCall, list[Any]]:
        tables = {name: self._table(device[name]) for name in ("inputs", "states", "hoisted", "outputs")}
        tables["params"] = self._table(self._params)
        tables["packed"] = self._table(self._packed)
        call = CxCall(num_nodes=lin.num_nodes, num_levels=lin.num_levels, max_children=lin.max_children,
                      num_roots=len(lin.roots),
                      **{field: int(device[field].gpudata)
                         for field in ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots")},
                      **{field: int(table.gpudata) for field, table in tables.items()})
        return call, list(tables.values())

    # --- running ------------------------------------------------------------------
    def forward(self, lin: Linearized, inputs: Mapping[str, np.ndarray], keep: bool = False, host: bool = True):
        abi, n = self.spec["abi"], lin.num_nodes
        zeros = self.gpuarray.zeros
        device: dict[str, Any] = {field: self._up(getattr(lin, field) if len(getattr(lin, field)) else
                                                  np.zeros(1, np.int64))
                                  for field in ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots")}
        device["inputs"] = [self._up(inputs[name]) for name in abi["inputs"]]
        device["states"] = [zeros((n + 1, *shape), np.float32) for shape in self.spec["state_shapes"]]
        device["hoisted"] = [zeros((max(n - lin.num_leaves, 1), w), np.float32) for w in self.spec["hoisted_widths"]]
        device["outputs"] = [zeros((len(lin.roots) if o["at_root"] else n, *o["shape"]), np.float32)
                             for o in self.spec["outputs"]]
        call, _tables = self._call(lin, device)
        if n and (status := self.lib.cx_forward(ctypes.byref(call), lin.level_ptr.ctypes.data)) != 0:
            raise CortexcError(f"the CUDA forward failed with cudaError {status}")
        if host:
            result = {name: state.get()[:n] for name, state in zip(abi["states"], device["states"])}
            result.update((name, out.get()) for name, out in zip(abi["outputs"], device["outputs"]))
        else:  # GPUArrays; a state's first n rows are a view (row n is the zero row missing children read)
            result = {name: state[:n] for name, state in zip(abi["states"], device["states"])}
            result.update(zip(abi["outputs"], device["outputs"]))
        return result, ((lin, device) if keep else None)

    def backward(self, saved, upstream: Mapping[str, np.ndarray],
                 param_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        lin, device = saved
        abi, n = self.spec["abi"], lin.num_nodes
        zeros = self.gpuarray.zeros
        d_params = [zeros(param_shapes[name], np.float32) for name in abi["params"]]
        index_inputs = {i["name"] for i in self.spec["inputs"] if i["dtype"] == "int32"}
        d_inputs = [None if name in index_inputs else zeros(array.shape, np.float32)
                    for name, array in zip(abi["inputs"], device["inputs"])]
        d_states = []
        for name, state in zip(abi["states"], device["states"]):
            d_state = np.zeros(state.shape, np.float32)
            if name in upstream:
                d_state[:n] = upstream[name]
            d_states.append(self._up(d_state))
        d_hoisted = [zeros(h.shape, np.float32) for h in device["hoisted"]]
        given = [None if name not in upstream else self._up(np.asarray(upstream[name], np.float32))
                 for name in abi["outputs"]]
        call, _tables = self._call(lin, device)
        grad_tables = [self._table(t) for t in (d_params, d_inputs, d_states, d_hoisted, given)]
        grad = CxGrad(*(int(t.gpudata) for t in grad_tables))
        mask = sum(1 << i for i, g in enumerate(given) if g is not None)
        if n and (status := self.lib.cx_backward(ctypes.byref(call), ctypes.byref(grad),
                                                  lin.level_ptr.ctypes.data, mask)) != 0:
            raise CortexcError(f"the CUDA backward failed with cudaError {status}")
        grads = {name: d.get() for name, d in zip(abi["params"], d_params)}
        grads.update((name, d.get()) for name, d in zip(abi["inputs"], d_inputs) if d is not None)
        return grads
