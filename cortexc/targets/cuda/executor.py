"""The CUDA executor (``device="cuda"``): the generated `.cu` built by nvcc, run on a GPU.

The `.cu` carries its own host side: the launch sequence (one persistent
cooperative launch, or one grid per kernel and level; see
`targets/cuda/templates/driver.j2`) and the device-memory calls (`cx_mem_*`), driven by
`host.DeviceExecutor` exactly as in the CPU emulation that CI runs. PyCUDA
makes the device's primary context current (it never creates one: torch and
the CUDA runtime inside the library use the primary context) and hands out
GPUArrays for results kept on the device (``host=False``); only this file and
the GPU driver are left for a GPU run to exercise.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from cortexc.errors import CortexcError
from cortexc.runtime.abi import LaunchOptions
from cortexc.runtime.build import build_shared
from cortexc.runtime.package import CellSpec

from .host import DeviceExecutor, cuda_include_flags

INSTALL_HINT = "install cortexc[cuda] on a machine with an NVIDIA driver"


_PRIMARY: dict[int, Any] = {}  # device ordinal -> its retained primary context (released at exit)


def cuda_device_ordinal() -> int:
    """The GPU to run on: torch's current device when torch has set up CUDA (so a `CellModule` and the
    NumPy API agree with torch), else ``CORTEXC_CUDA_DEVICE`` (default 0)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    text = os.environ.get("CORTEXC_CUDA_DEVICE", "0").strip()
    if not (text.isascii() and text.isdigit()):
        raise CortexcError(f"CORTEXC_CUDA_DEVICE={text!r}: expected a device number")
    return int(text)


def _pycuda():
    """PyCUDA's driver and gpuarray modules with the device's *primary* context current in this thread:
    retained and pushed, never created (``pycuda.autoinit`` makes a context of its own, which does not
    coexist with torch or with the CUDA runtime inside the generated library, which use the primary
    one); a clear error where they cannot be had."""
    try:
        import pycuda.driver as driver
        import pycuda.gpuarray as gpuarray
    except ImportError as err:
        raise CortexcError(f"device='cuda' needs PyCUDA ({err}): {INSTALL_HINT}") from None
    try:
        driver.init()
        ordinal = cuda_device_ordinal()
        if ordinal not in _PRIMARY:
            if ordinal >= driver.Device.count():
                raise CortexcError(f"device='cuda': there is no GPU {ordinal} ({driver.Device.count()} found)")
            context = driver.Device(ordinal).retain_primary_context()
            context.push()
            _PRIMARY[ordinal] = context
            atexit.register(_release, context)
    except CortexcError:
        raise
    except Exception as err:  # pycuda raises its own error types when there is no driver or device
        raise CortexcError(f"device='cuda' found no usable GPU ({err}): {INSTALL_HINT}") from None
    return driver, gpuarray


def _release(context: Any) -> None:
    """Pop the primary context pushed by `_pycuda` (its retain is dropped with the object)."""
    with contextlib.suppress(Exception):  # the driver may be shut down already at exit
        context.pop()


class CudaExecutor(DeviceExecutor):
    """Runs one compiled cell on the GPU. `spec` is the cell's entry of the generated JSON."""

    def __init__(
        self,
        spec: CellSpec,
        cuda_source: str,
        name: str,
        launch: LaunchOptions | None = None,
        arch: tuple[int, int] | None = None,
    ):
        """`arch`: the GPU's compute capability when the caller knows it and keeps its arrays itself
        (`cortexc.torch`: torch's CUDA tensors, torch's primary context); PyCUDA is then not used."""
        if arch is None:
            self.driver, self.gpuarray = _pycuda()
            major, minor = self.driver.Context.get_device().compute_capability()
        else:
            self.driver = self.gpuarray = None
            major, minor = arch
        flags: tuple[str, ...] = (
            "-x",
            "cu",
            "-O3",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            f"-arch=sm_{major}{minor}",
        )  # a .cu, named .c
        flags += cuda_include_flags()
        library = build_shared(
            cuda_source, f"{name}_sm{major}{minor}", compiler="nvcc", flags=flags, purpose="device='cuda'"
        )
        super().__init__(spec, library, launch)

    def _on_device(self, where: Mapping[str, tuple[int, tuple[int, ...]]]) -> dict[str, Any]:
        """``host=False``: each result copied, device to device, into a GPUArray of its own (the arena goes
        back to the pool for the next call)."""
        if self.gpuarray is None:
            raise CortexcError("host=False needs the executor made with PyCUDA (no arch given)")
        arrays = {}
        for key, (address, shape) in where.items():
            array = self.gpuarray.empty(shape, np.float32)
            if array.nbytes:
                self.driver.memcpy_dtod(array.gpudata, address, array.nbytes)
            arrays[key] = array
        return arrays
