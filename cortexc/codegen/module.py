"""The generated package: `__init__.py` (from a template), kernel sources and `cell.json`.

`cell.json` describes every cell: its runtime signature (dims, params and
inits, inputs, states, outputs, structure), the kernel ABI (the pointer
layout the runtime must pass), the schedule and the kernels' hashes. That is
all the runtime reads: importing a package loads no compiler module. It also
carries the `.cell` source and `-D` values, which only `device="interp"`
compiles again, to run the reference interpreter on the IR. Files are
written to a temporary directory and moved into place only when all of them
are ready: a failed compile leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import keyword
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cortexc import __version__
from cortexc.codegen.render import abi, environment, hoist_window
from cortexc.codegen.target import TARGETS
from cortexc.errors import OutputError
from cortexc.ir.cell import Cell
from cortexc.ir.ops import Op
from cortexc.ir.program import Program, hoisted_widths
from cortexc.ir.signature import cell_signature
from cortexc.options import CompileOptions

if TYPE_CHECKING:
    from cortexc.pipeline import Rendered

FORMAT_VERSION = 5


@dataclass(frozen=True)
class PackageFiles:
    """A generated package, in memory: its import name and its files (name -> text)."""

    name: str
    files: tuple[tuple[str, str], ...]


def package_name(path: str | os.PathLike) -> str:
    """The package a `.cell` file compiles to: its stem, made a Python identifier."""
    stem = Path(path).stem
    name = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    if not name or name[0].isdigit():
        name = f"cell_{name}"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in ("None", "True", "False"):
        name += "_"  # `import class` is a syntax error; `import class_` is not
    return name


def _step_json(step: Any) -> dict[str, Any]:
    fields = asdict(step) if is_dataclass(step) and not isinstance(step, type) else {}
    fields = {k: (v.value if hasattr(v, "value") else v) for k, v in fields.items()}
    return {"step": type(step).__name__.lower(), **fields}


def _deferred_json(program: Program) -> list[dict[str, Any]]:
    """A program's deferred weight-gradient terms, as the runtime sizes their factor rows."""
    return [
        {"rows": t.rows.value, "m": t.m, "k": t.k, "param": t.param, "narrow": t.narrow} for t in program.deferred or ()
    ]


def _packed_json(program: Program) -> list[dict[str, Any]]:
    """A program's packed weights, in the order its kernels index `cx_call.packed`, as the runtime packs them."""
    return [
        {
            "name": w.name,
            "params": list(w.params),
            "m": w.m,
            "k": w.k,
            "transposed": list(w.transposed),
            "blocks": list(w.blocks),
        }
        for w in program.packed
    ]


def cell_spec(cell: Cell, program: Program, kernel_files: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": cell.name,
        "signature": cell_signature(cell).to_json(),
        "structure": cell.structure.value,
        "arity": cell.arity,
        "dims": dict(cell.dims),
        "params": [{"name": p.name, "shape": list(p.shape), "init": str(p.init)} for p in cell.params],
        "inputs": [
            {
                "name": i.name,
                "shape": list(i.shape),
                "dtype": "int32" if i.is_index else "float32",
                "index_range": i.index_range,
            }
            for i in cell.inputs
        ],
        "states": [{"name": s.name, "shape": list(s.shape)} for s in cell.states],
        "state_shapes": [list(s.shape) for s in cell.states],
        "outputs": [{"name": o.name, "shape": list(o.shape), "at_root": o.at_root} for o in cell.outputs],
        "hoisted_widths": hoisted_widths(cell),
        "abi": abi(cell, program),
        "kernels": dict(kernel_files),
        "deferred": _deferred_json(program),  # the last target's (CUDA's when it is built): runtime/device.py
        "dropout_sites": len(
            {v.attr("site") for body in cell.bodies() for v in body.values if v.op == Op.DROPOUT}
        ),  # 0: training mode changes nothing (cortexc.torch then draws no seed)
        "schedule": [
            {
                "kernel": k.name,
                "rows": k.rows.value,
                "steps": [_step_json(s) for s in k.steps],
                "column_period": k.split.period if k.split is not None else None,
            }
            for k in program.kernels
        ],
    }


def package_files(source: str, source_file: str, options: CompileOptions, rendered: Sequence[Rendered]) -> PackageFiles:
    """The files of the package of a compiled `.cell` file (nothing is written here)."""
    name = package_name(source_file)
    files: dict[str, str] = {}
    specs = []
    for item in rendered:
        kernel_files, hashes = {}, {}
        for target_name, text in item.sources:
            kernel_file = f"{item.cell.name}{TARGETS[target_name].source_suffix}"
            files[kernel_file] = text
            kernel_files[target_name] = kernel_file
            hashes[target_name] = hashlib.sha256(text.encode()).hexdigest()
        # the launch schedule is the same for every target but for the column split, which is the CUDA one's
        program = item.programs[-1].program
        spec = cell_spec(item.cell, program, kernel_files)
        # the deferred weight gradients differ by target (C keeps small ones per tile): each kernel's own
        spec["deferred_by_target"] = {v.target: _deferred_json(v.program) for v in item.programs}
        # the packed weights differ by target too (C's direct node kernel has one of its own): each library's
        spec["packed"] = {v.target: _packed_json(v.program) for v in item.programs}
        spec["kernel_sha256"] = hashes
        # the folded look-up projections of the C program (the one target that folds): what `cx_fold` builds
        c_program = next((v.program for v in item.programs if v.target == "c"), None)
        spec["folds"] = [
            {"name": f.name, "packed": f.packed, "table": f.table, "rows": f.rows, "m": f.m, "k": f.k}
            for f in (c_program.folds if c_program is not None else ())
        ]
        # what a training forward of the C program keeps for its backward (`passes.saving`): `cx_call.saved`
        spec["saved"] = [
            {"name": v.name, "width": v.width, "rows": "internal" if v.internal else "leaves"}
            for v in (c_program.saved if c_program is not None else ())
        ]
        # an inference may hoist a window of levels at a time (the C driver): the rows the runtime gives it
        window = hoist_window(c_program, TARGETS["c"]) if c_program is not None else None
        spec["hoisted_window_rows"] = window["rows"] if window is not None else 0
        # a training forward may too where its backward reads no hoisted row (it then keeps none for it)
        training = hoist_window(c_program, TARGETS["c"], training=True) if c_program and window else None
        spec["training_window"] = training is not None
        spec["launch"] = options.launch.to_json()
        specs.append(spec)
    description = {
        "format": FORMAT_VERSION,
        "cortexc": __version__,
        "package": name,
        "source_file": str(source_file),
        "source": source,
        "defines": options.define_map,
        "targets": list(options.targets),
        "cells": specs,
    }
    files["cell.json"] = json.dumps(description, indent=1, sort_keys=False) + "\n"
    files["__init__.py"] = (
        environment()
        .get_template("module_init.py.j2")
        .render(
            source_file=source_file,
            cell_names=[item.cell.name for item in rendered],
            kernel_files=[f for s in specs for f in s["kernels"].values()],
        )
    )
    return PackageFiles(name, tuple(files.items()))


def install_package(out: Path, package: PackageFiles) -> Path:
    """Put the package in `out/<name>/` whole or not at all; returns its path."""
    try:
        return _install(out, package.name, dict(package.files))
    except OSError as err:  # a read-only or full disk, `out` a file or below one
        where = err.filename or out
        raise OutputError(f"cannot write the package {package.name} to {out}: {where}: {err.strerror or err}") from None


def _install(out: Path, name: str, files: dict[str, str]) -> Path:
    """Put the package in `out/name` whole or not at all; an identical package already there is kept as is.

    The files are written to a staging directory and renamed into place only where nothing is (a rename
    onto a non-empty directory fails), so a reader never sees a half-written package, and a complete
    identical package, one another process may be importing, is never moved: concurrent writers of the
    same package (several processes calling `cortexc.load` into one cache) all succeed. Only a different
    package in the way is moved aside, then the rename is tried again.
    """
    out.mkdir(parents=True, exist_ok=True)
    final = out / name
    if _same_contents(final, files):
        return final
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; a package is as readable as any file
        for file_name, text in files.items():
            (staging / file_name).write_text(text, encoding="utf-8")
        for _ in range(_INSTALL_ATTEMPTS):
            if final.is_symlink() or final.is_file():
                with contextlib.suppress(FileNotFoundError):
                    final.unlink()
            try:
                os.replace(staging, final)  # only onto nothing (or an empty directory)
                return final
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            if _same_contents(final, files):  # another writer installed this same package first
                return final
            retired = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=out))
            with contextlib.suppress(FileNotFoundError):  # another writer may have moved it first
                os.replace(final, retired / name)
            shutil.rmtree(retired, ignore_errors=True)
        raise OSError(errno.EBUSY, f"other processes keep installing different packages at {final}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


#: how often a different package in the way is moved aside before giving up (other writers keep racing)
_INSTALL_ATTEMPTS = 5


def _same_contents(directory: Path, files: dict[str, str]) -> bool:
    if not directory.is_dir() or directory.is_symlink():
        return False
    present = {p.name for p in directory.iterdir()}
    if present != set(files):
        return False
    try:
        return all((directory / n).read_text(encoding="utf-8") == text for n, text in files.items())
    except OSError:
        return False
