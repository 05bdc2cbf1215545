"""The classes of a generated package: one per cell, sharing this base.

A model holds its params (float32, read-only arrays: change them with
`load_params`, which also re-packs the GEMM weights) and runs a forest on a
device: ``"cpu"`` (the generated C, built on first use and cached by source
hash) or ``"interp"`` (the reference interpreter, the eager baseline).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from cortexc.errors import CortexcError, InputError
from cortexc.ir import interp
from cortexc.ir.cell import Cell
from cortexc.runtime.forest import Forest
from cortexc.runtime.params import check_params, init_params
from cortexc.runtime.validate import check_forest, check_inputs

#: "cuda-emu" runs the CUDA target's code on the CPU through the emulation harness (for tests: slow)
DEVICES = ("cpu", "interp", "cuda", "cuda-emu")


class Outputs(dict):
    """A model's results by name; with ``grad=True`` it also carries what `backward` needs."""

    saved: tuple | None = None


class CellModel:
    """A compiled cell. Subclasses are made by `load_package`; do not instantiate this directly."""

    _package: ClassVar[Path]
    _kernel_sources: ClassVar[dict[str, str]]  # by target, read at import and checked against their hashes
    _description: ClassVar[dict[str, Any]]
    _spec: ClassVar[dict[str, Any]]
    cell: ClassVar[Cell]  # the checked IR of the cell (what inputs are validated against)

    def __init__(self, device: str = "cpu", seed: int | None = 0):
        if device not in DEVICES:
            raise CortexcError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
        target = {"cpu": "c", "cuda": "cuda", "cuda-emu": "cuda"}.get(device)
        if target is not None and target not in type(self)._kernel_sources:
            raise CortexcError(
                f"device={device!r} needs the {target} kernels, which this package was compiled "
                f"without (cortexc compile --target {'cpu' if target == 'c' else 'cuda'} or all)"
            )
        self.device = device
        self._params = _frozen(init_params(self.cell, seed))
        self._executor = None

    # --- params ---------------------------------------------------------------
    @property
    def params(self) -> Mapping[str, np.ndarray]:
        """Name -> float32 array (read-only, arrays and mapping; use `load_params` to change them)."""
        return MappingProxyType(self._params)

    def load_params(self, params: Mapping[str, np.ndarray] | str | os.PathLike) -> None:
        """Replace some or all params (a dict or an `.npz` path); every shape is checked."""
        checked = check_params(self.cell, params, partial=True)
        self._params = _frozen({**self._params, **checked})
        if self._executor is not None:
            self._executor.set_params(self._params)

    def save_params(self, path: str | os.PathLike) -> None:
        np.savez(path, **self._params)

    # --- running ----------------------------------------------------------------
    def __call__(self, forest: Forest, grad: bool = False, host: bool = True, **inputs: Any) -> Outputs:
        """States `[N, ...]` in the forest's node order and every output, for the whole forest.

        With ``grad=True`` the result also keeps what `backward` needs (the
        forest, the inputs and every state; the rest is recomputed). With
        ``host=False`` on ``device="cuda"`` the arrays stay on the GPU (PyCUDA
        ``GPUArray``s, no copy back) for callers that go on there; every other
        device computes in host memory and returns NumPy arrays either way.
        """
        check_forest(self.cell, forest)
        checked = check_inputs(self.cell, forest, inputs)
        if self.device == "interp":
            out = interp.run(self.cell, forest, self._params, checked)
            kept = None
        else:
            from cortexc.runtime.linearize import linearize

            executor = self._executor_for_device()
            if host:
                out, kept = executor.forward(linearize(forest), checked, keep=grad)
            else:
                out, kept = executor.forward(linearize(forest), checked, keep=grad, host=False)
        result = Outputs(out)
        if grad:
            result.saved = (forest, checked, {s.name: out[s.name] for s in self.cell.states}, kept)
        return result

    def backward(self, out: Outputs, upstream: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Gradients of every param and every float input, given upstream gradients of outputs/states."""
        saved = getattr(out, "saved", None)
        if saved is None:
            raise CortexcError("backward needs the result of model(forest, grad=True, ...)")
        forest, inputs, states, kept = saved
        checked = {}
        for name, grad in upstream.items():
            if name not in out:
                known = ", ".join(out)
                raise InputError(f"no output or state named {name!r} to take a gradient of (there are: {known})")
            array = np.asarray(grad)
            if array.shape != out[name].shape:
                raise InputError(f"the gradient of {name} must have shape {out[name].shape}, got {array.shape}")
            checked[name] = np.ascontiguousarray(array, dtype=np.float32)
        if self.device == "interp":
            return interp.backward(self.cell, forest, self._params, inputs, states, checked)
        shapes = {p.name: p.shape for p in self.cell.params}
        return self._executor_for_device().backward(kept, checked, shapes)

    def _executor_for_device(self):
        """The executor of this model's device, built (or loaded from the cache) on first use."""
        if self._executor is None:
            name = f"{self._description['package']}_{self.cell.name}"
            sources = type(self)._kernel_sources
            if self.device == "cpu":
                from cortexc.runtime.build import build_shared
                from cortexc.runtime.cpu import CpuExecutor

                kernel_path = type(self)._package / self._spec["kernels"]["c"]
                executor = CpuExecutor(self._spec, build_shared(sources["c"], name, kernel_path))
            elif self.device == "cuda-emu":
                from cortexc.runtime.cuda_emulated import EmulatedCudaExecutor

                executor = EmulatedCudaExecutor(self._spec, sources["cuda"], name)
            else:
                from cortexc.runtime.cuda import CudaExecutor

                executor = CudaExecutor(self._spec, sources["cuda"], name)
            executor.set_params(self._params)
            self._executor = executor
        return self._executor

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r})"


def _frozen(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    frozen = {}
    for name, value in params.items():
        array = np.array(value, dtype=np.float32, copy=True)
        array.flags.writeable = False
        frozen[name] = array
    return frozen


def load_package(directory: str | os.PathLike) -> dict[str, type[CellModel]]:
    """The model classes of a generated package, by cell name."""
    from cortexc.pipeline import compile_source

    directory = Path(directory)
    description = json.loads((directory / "cell.json").read_text(encoding="utf-8"))
    cells = {
        c.name: c for c in compile_source(description["source"], description["source_file"], description["defines"])
    }
    classes: dict[str, type[CellModel]] = {}
    for spec in description["cells"]:
        sources = {}
        for target, file_name in spec["kernels"].items():
            kernel_path = directory / file_name
            sources[target] = kernel_path.read_text(encoding="utf-8")
            if hashlib.sha256(sources[target].encode()).hexdigest() != spec["kernel_sha256"][target]:
                raise CortexcError(
                    f"{kernel_path} does not match {directory / 'cell.json'} (the package was "
                    "changed after it was generated): compile it again"
                )
        attributes = {
            "_kernel_sources": sources,
            "_package": directory,
            "_description": description,
            "_spec": spec,
            "cell": cells[spec["name"]],
            "__doc__": f"The cell {spec['name']} of {description['source_file']} (compiled by cortexc).",
            "__module__": description["package"],
        }
        classes[spec["name"]] = type(spec["name"], (CellModel,), attributes)
    return classes
