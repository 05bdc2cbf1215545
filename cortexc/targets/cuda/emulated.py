"""Running the emitted CUDA on the CPU: the `.cu` compiled by g++ against `cuda_emu.h`.

This is how CI proves the CUDA target without a GPU: the exact source nvcc
would compile, host launch logic and device-memory calls included, runs with
every thread of a block as a fiber and real `__syncthreads()` barriers, driven
by the same executor as a GPU (`host.DeviceExecutor`: one arena per call,
params uploaded once). Only the driver beneath the CUDA runtime differs: here
"device" memory is host memory handed out by the emulator's `cudaMalloc`.
"""

from __future__ import annotations

from pathlib import Path

from cortexc.runtime.abi import LaunchOptions
from cortexc.runtime.build import build_shared
from cortexc.runtime.package import CellSpec

from .host import DeviceExecutor, cuda_include_flags

EMU_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-Wall", "-Wno-unused-function", "-x", "c++")


def build_emulated(source: str, name: str, source_path: str | Path | None = None) -> Path:
    """The shared library of a `.cu` source built for the emulator (cached like any build)."""
    flags = (*EMU_FLAGS[:-2], *cuda_include_flags(), "-include", "cuda_emu.h", *EMU_FLAGS[-2:])
    return build_shared(source, f"{name}_emu", source_path, compiler="g++", flags=flags, purpose="device='cuda-emu'")


class EmulatedCudaExecutor(DeviceExecutor):
    """The CUDA target's host code and kernels, emulated on the CPU (tests; no GPU needed)."""

    def __init__(self, spec: CellSpec, cuda_source: str, name: str, launch: LaunchOptions | None = None):
        super().__init__(spec, build_emulated(cuda_source, name), launch)
