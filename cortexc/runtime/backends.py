"""The one table of backends: a device name, the kernel target it runs and how to make its executor.

`CellModel(device=...)`, the CLI, `cortexc.load` and `cortexc.torch` all read this table, which the
registered target folders fill (`cortexc/targets/<name>/backends.py`); the interpreter is the one backend
of no target. Factories import their executor module only when used, so that listing the backends (or
importing cortexc) costs nothing and needs no GPU library.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any

from cortexc.runtime.executor import Backend as Backend
from cortexc.runtime.executor import Executor
from cortexc.runtime.executor import ExecutorRequest as ExecutorRequest
from cortexc.targets import NAMES


def _interp(request: ExecutorRequest) -> Executor:
    from cortexc.reference import InterpExecutor

    return InterpExecutor(request.compile_ir)


def compile_ir(source: str, source_file: str, defines: Mapping[str, int], name: str) -> Any:
    """The IR (with gradient bodies) of cell `name` of a package's `.cell` source, which only the interpreter
    and IR-level tools need (`CellModel.cell`). With `_interp`, the runtime's one way up into the compiler:
    both go through `cortexc.reference`, above the pipeline (`scripts/layers.py`)."""
    from cortexc.reference import cell_ir

    return cell_ir(source, source_file, defines, name)


#: every device: the registered targets' (`cortexc.targets.NAMES`, each folder's `backends.py`), then the
#: interpreter's
BACKENDS: dict[str, Backend] = {
    backend.device: backend
    for backend in (
        *(b for name in NAMES for b in import_module(f"cortexc.targets.{name}.backends").BACKENDS),
        Backend("interp", None, _interp, "the reference interpreter on the IR (compiles the cell's source again)"),
    )
}


#: `CellModel`'s and `cortexc run`'s device when none is named: the first registered target's first (``"cpu"``)
DEFAULT_DEVICE: str = next(iter(BACKENDS))


def backend(device: str) -> Backend:
    """The backend of a device name, or a `CortexcError` listing the known ones."""
    from cortexc.errors import CortexcError

    if device not in BACKENDS:
        raise CortexcError(f"unknown device {device!r} (choose from {', '.join(BACKENDS)})")
    return BACKENDS[device]


def backends_for(tensors: str) -> tuple[str, ...]:
    """The devices whose executors `cortexc.torch` can run on tensors of this torch device type (``"cpu"``,
    ``"cuda"``: `Backend.tensors`), the default first."""
    return tuple(device for device, b in BACKENDS.items() if b.tensors == tensors)


def targets_of(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The kernel targets these devices need, in table order."""
    found = [BACKENDS[d].target for d in BACKENDS if d in devices and BACKENDS[d].target is not None]
    return tuple(dict.fromkeys(t for t in found if t is not None))
