"""Parameter initialisation (the `init` of each `param`) and loading with shape checks."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from cortexc.errors import CortexcError, InputError
from cortexc.runtime.signature import CellSignature, ParamSig
from cortexc.runtime.validate import as_array, signature

if TYPE_CHECKING:
    from cortexc.ir.cell import Cell


def init_param(decl: ParamSig, rng: np.random.Generator, dtype: type = np.float32) -> np.ndarray:
    """One param as declared. Xavier is Glorot-uniform with fan_in = columns, fan_out = rows
    (torch's `xavier_uniform_` on a `[out, in]` weight); a vector counts as `[n, 1]`."""
    shape, init = decl.shape, decl.init
    if init.kind == "zeros":
        value = np.zeros(shape)
    elif init.kind == "ones":
        value = np.ones(shape)
    elif init.kind == "uniform":
        value = rng.uniform(init.args[0], init.args[1], size=shape)
    elif init.kind == "normal":
        value = rng.normal(init.args[0], init.args[1], size=shape)
    elif init.kind == "xavier":
        fan_out, fan_in = (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        value = rng.uniform(-bound, bound, size=shape)
    else:
        raise CortexcError(f"param {decl.name}: unknown init {init.kind!r}")
    return np.ascontiguousarray(value, dtype=dtype)


def init_params(cell: CellSignature | Cell, seed: int | None = 0, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Every param of the cell, initialised in declaration order from one seeded generator."""
    cell = signature(cell)
    rng = np.random.default_rng(seed)
    return {decl.name: init_param(decl, rng, dtype) for decl in cell.params}


def check_params(
    cell: CellSignature | Cell,
    params: Mapping[str, np.ndarray] | str | os.PathLike[str],
    partial: bool = False,
    dtype: type = np.float32,
) -> dict[str, np.ndarray]:
    """Params by name (or an `.npz` or `.safetensors` path) as contiguous arrays, every shape checked.

    With ``partial`` only the given names are checked (for `load_params` of a subset).
    """
    cell = signature(cell)
    if isinstance(params, str | os.PathLike):
        params = read_params_file(params)
    declared = {decl.name: decl for decl in cell.params}
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise InputError(f"cell {cell.name} has no param {', '.join(unknown)} (its params: {', '.join(declared)})")
    missing = [name for name in declared if name not in params]
    if missing and not partial:
        raise InputError(f"missing params for cell {cell.name}: {', '.join(missing)}")
    checked: dict[str, np.ndarray] = {}
    for name, value in params.items():
        array = as_array(value, f"param {name}")
        if array.shape != declared[name].shape:
            raise InputError(f"param {name} must have shape {declared[name].shape}, got {array.shape}")
        if not np.issubdtype(array.dtype, np.floating):
            raise InputError(f"param {name} must be a float array, got dtype {array.dtype}")
        checked[name] = np.ascontiguousarray(array, dtype=dtype)
    return checked


def read_params_file(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every array of an `.npz` or (by its suffix) `.safetensors` file, by name."""
    from cortexc.runtime import safetensors

    if safetensors.is_safetensors(path):
        return safetensors.load(path)
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


def write_params_file(path: str | os.PathLike[str], params: Mapping[str, np.ndarray]) -> None:
    """Params to an `.npz` or (by its suffix) `.safetensors` file; what `read_params_file` reads back."""
    from cortexc.runtime import safetensors

    if safetensors.is_safetensors(path):
        safetensors.save(path, params)
    else:
        np.savez(path, **params)  # type: ignore[arg-type]  # numpy's stub types **kwds as savez's flags
