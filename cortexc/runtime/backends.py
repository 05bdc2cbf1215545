"""The one table of backends: a device name, the kernel target it runs and how to make its executor.

`CellModel(device=...)`, the CLI and `cortexc.load` all read this table. A
new backend is one code-generation `Target` (`cortexc/codegen/target.py`),
its dialect template, one executor module and one entry here. Factories
import their executor module only when used, so that listing the backends
(or importing cortexc) costs nothing and needs no GPU library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cortexc.runtime.executor import Executor
from cortexc.runtime.package import CellSpec


@dataclass(frozen=True)
class ExecutorRequest:
    """What a factory gets: the cell's `cell.json` entry, its kernel source for the backend's target
    (already checked against its hash; empty for the interpreter), where that source lives, a name for
    build caches, and a way to get the cell's IR (it compiles the source: only the interpreter asks).
    `arch`: the GPU's compute capability, where the caller knows it and keeps the arrays itself
    (`cortexc.torch`: torch's CUDA device); the cuda backend then builds for it and needs no PyCUDA."""

    spec: CellSpec
    source: str
    source_path: Path
    name: str
    compile_ir: Callable[[], Any]
    arch: tuple[int, int] | None = None


@dataclass(frozen=True)
class Backend:
    device: str  # what users pass as `device=`
    target: str | None  # the kernel source it runs (a `cortexc.options.KNOWN_TARGETS` name); None: the IR
    make_executor: Callable[[ExecutorRequest], Executor]
    summary: str


def _cpu(request: ExecutorRequest) -> Executor:
    from cortexc.runtime.build import build_shared
    from cortexc.runtime.cpu import CpuExecutor

    return CpuExecutor(request.spec, build_shared(request.source, request.name, request.source_path))


def _interp(request: ExecutorRequest) -> Executor:
    from cortexc.reference import InterpExecutor

    return InterpExecutor(request.compile_ir)


def compile_ir(source: str, source_file: str, defines: Mapping[str, int], name: str) -> Any:
    """The IR (with gradient bodies) of cell `name` of a package's `.cell` source, which only the interpreter
    and IR-level tools need (`CellModel.cell`). With `_interp`, the runtime's one way up into the compiler:
    both go through `cortexc.reference`, above the pipeline (`scripts/layers.py`)."""
    from cortexc.reference import cell_ir

    return cell_ir(source, source_file, defines, name)


def _cuda(request: ExecutorRequest) -> Executor:
    from cortexc.runtime.cuda import CudaExecutor

    return CudaExecutor(request.spec, request.source, request.name, arch=request.arch)


def _cuda_emulated(request: ExecutorRequest) -> Executor:
    from cortexc.runtime.cuda_emulated import EmulatedCudaExecutor

    return EmulatedCudaExecutor(request.spec, request.source, request.name)


BACKENDS: dict[str, Backend] = {
    backend.device: backend
    for backend in (
        Backend("cpu", "c", _cpu, "the generated C, built with gcc and OpenMP (cached by source and flags)"),
        Backend("interp", None, _interp, "the reference interpreter on the IR (compiles the cell's source again)"),
        Backend("cuda", "cuda", _cuda, "the generated CUDA, built with nvcc for the GPU's arch (needs pycuda)"),
        Backend("cuda-emu", "cuda", _cuda_emulated, "the generated CUDA run on the CPU by cuda_emu.h (tests)"),
    )
}


def backend(device: str) -> Backend:
    """The backend of a device name, or a `CortexcError` listing the known ones."""
    from cortexc.errors import CortexcError

    if device not in BACKENDS:
        raise CortexcError(f"unknown device {device!r} (choose from {', '.join(BACKENDS)})")
    return BACKENDS[device]


def targets_of(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The kernel targets these devices need, in table order."""
    found = [BACKENDS[d].target for d in BACKENDS if d in devices and BACKENDS[d].target is not None]
    return tuple(dict.fromkeys(t for t in found if t is not None))
