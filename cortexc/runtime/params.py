"""Parameter initialisation (the `init` of each `param`) and loading with shape checks."""

from __future__ import annotations

import numbers
import os
import threading
import weakref
import zipfile
import zlib
from collections.abc import Mapping

import numpy as np

from cortexc.errors import CortexcError, InputError
from cortexc.runtime.signature import ParamSig
from cortexc.runtime.validate import AnyCell, as_array, signature

_HANDED_OVER: dict[int, weakref.ref] = {}  # id -> the array: arrays `load_params` may keep without a copy
_HANDED_OVER_LOCK = threading.Lock()


def hand_over(array: np.ndarray) -> np.ndarray:
    """Mark a fresh array that nothing else holds or will write (an optimizer's result) as one that
    `load_params` may keep as it is instead of freezing a copy; it is made read-only here. For a
    float32 C-contiguous array that owns its memory (else `load_params` copies as usual)."""
    array.flags.writeable = False
    key = id(array)

    def forget(_ref: weakref.ref, key: int = key) -> None:
        with _HANDED_OVER_LOCK:
            if _HANDED_OVER.get(key) is _ref:
                del _HANDED_OVER[key]

    with _HANDED_OVER_LOCK:
        _HANDED_OVER[key] = weakref.ref(array, forget)
    return array


def take_over(array: np.ndarray) -> bool:
    """Whether `array` was handed over (`hand_over`) and may be kept without a copy; it can be taken once."""
    with _HANDED_OVER_LOCK:
        ref = _HANDED_OVER.pop(id(array), None)
    return (
        ref is not None
        and ref() is array
        and array.dtype == np.float32
        and array.flags.c_contiguous
        and not array.flags.writeable
        and array.base is None
    )


def init_param(decl: ParamSig, rng: np.random.Generator, dtype: type = np.float32) -> np.ndarray:
    """One param as declared. Xavier is Glorot-uniform with fan_in = columns, fan_out = rows
    (torch's `xavier_uniform_` on a `[out, in]` weight); a vector counts as `[n, 1]`, and each matrix
    `W[r]` of a 3-D family `[R, M, K]` as an `[M, K]` one."""
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
        fan_out, fan_in = (shape[-2], shape[-1]) if len(shape) >= 2 else (shape[0], 1)
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        value = rng.uniform(-bound, bound, size=shape)
    else:
        raise CortexcError(f"param {decl.name}: unknown init {init.kind!r}")
    return np.ascontiguousarray(value, dtype=dtype)


def init_params(cell: AnyCell, seed: int | None = 0, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Every param of the cell, initialised in declaration order from one seeded generator."""
    cell = signature(cell)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise InputError(f"seed must be None or a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    return {decl.name: init_param(decl, rng, dtype) for decl in cell.params}


#: how every .npz (a zip archive) starts: a local file header, or the end record of an empty archive
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def _read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` file (as `save_params` writes), or an `InputError` saying what is wrong with it:
    missing, not an archive (a `.npy`, random bytes, empty), damaged (truncated, bad CRC), or holding objects."""
    shown = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as err:
        raise InputError(f"cannot read the params file {shown}: {err.strerror or err}") from None
    if head not in _ZIP_MAGIC:
        raise InputError(f"{shown} is not an .npz archive (as numpy.savez and save_params write)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError) as err:
        raise InputError(f"{shown} is a damaged .npz archive, or holds objects rather than arrays: {err}") from None


def check_params(
    cell: AnyCell,
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
    if not isinstance(params, Mapping):
        raise InputError(f"params must be a mapping of names to arrays or an .npz path, got {type(params).__name__}")
    named = [key for key in params if not isinstance(key, str)]
    if named:
        raise InputError(f"param names must be strings, got {named[0]!r}")
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
    return _read_npz(path)


def write_params_file(path: str | os.PathLike[str], params: Mapping[str, np.ndarray]) -> None:
    """Params to an `.npz` or (by its suffix) `.safetensors` file; what `read_params_file` reads back."""
    from cortexc.runtime import safetensors

    if safetensors.is_safetensors(path):
        safetensors.save(path, params)
    else:
        np.savez(path, **params)  # type: ignore[arg-type]  # numpy's stub types **kwds as savez's flags
