"""Running the emitted CUDA on the CPU: the `.cu` compiled by g++ against `cuda_emu.h`.

This is how CI proves the CUDA target without a GPU: the exact source nvcc
would compile, host launch logic included, runs with every thread of a block
as a fiber and real `__syncthreads()` barriers. Only the last layer (device
memory and the driver) differs from a GPU run: here "device" memory is host
memory, so the same pointer tables the CPU executor fills serve as-is.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from cortexc.errors import CortexcError
from cortexc.runtime.build import build_shared
from cortexc.runtime.cpu import CpuExecutor, CxCall, CxGrad
from cortexc.runtime.linearize import Linearized

EMU_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-Wall", "-Wno-unused-function", "-x", "c++")


def emulator_header_dir() -> Path:
    return Path(str(resources.files("cortexc.runtime").joinpath("cuda_emu.h"))).parent


def build_emulated(source: str, name: str, source_path: str | Path | None = None) -> Path:
    """The shared library of a `.cu` source built for the emulator (cached like any build)."""
    include = emulator_header_dir()
    flags = (*EMU_FLAGS[:-2], f"-I{include}", "-include", "cuda_emu.h", *EMU_FLAGS[-2:])
    return build_shared(source, f"{name}_emu", source_path, compiler="g++", flags=flags)


class EmulatedCudaExecutor(CpuExecutor):
    """The CUDA target's host code and kernels, emulated on the CPU (tests; no GPU needed)."""

    def __init__(self, spec: Mapping[str, Any], cuda_source: str, name: str):
        super().__init__(spec, build_emulated(cuda_source, name))

    def _declare_entry_points(self) -> None:
        self.lib.cx_forward.argtypes = [ctypes.POINTER(CxCall), ctypes.c_void_p]
        self.lib.cx_forward.restype = ctypes.c_int
        if hasattr(self.lib, "cx_backward"):
            self.lib.cx_backward.argtypes = [ctypes.POINTER(CxCall), ctypes.POINTER(CxGrad), ctypes.c_void_p,
                                             ctypes.c_int64]
            self.lib.cx_backward.restype = ctypes.c_int

    def _launch_forward(self, call: CxCall, lin: Linearized) -> None:
        status = self.lib.cx_forward(ctypes.byref(call), lin.level_ptr.ctypes.data)
        if status != 0:
            raise CortexcError(f"the emulated CUDA forward failed with cudaError {status}")

    def _launch_backward(self, call: CxCall, grad: CxGrad, lin: Linearized, upstream_mask: int) -> None:
        status = self.lib.cx_backward(ctypes.byref(call), ctypes.byref(grad), lin.level_ptr.ctypes.data,
                                      upstream_mask)
        if status != 0:
            raise CortexcError(f"the emulated CUDA backward failed with cudaError {status}")
