"""The generated package: `__init__.py` (from a template), kernel sources and `cell.json`.

`cell.json` describes every cell (dims, params, inputs, states, outputs, the
kernel schedule and the pointer layout the runtime must pass) and carries the
`.cell` source and `-D` values it was compiled with, so the runtime can
rebuild the IR for input validation and for the interpreter. Files are
written to a temporary directory and moved into place only when all of them
are ready: a failed compile leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import keyword
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from cortexc import __version__
from cortexc.codegen.render import abi, deferred_outer_products, environment, render
from cortexc.codegen.target import TARGETS, Target
from cortexc.errors import CortexcError
from cortexc.ir.cell import Cell
from cortexc.ir.program import Program
from cortexc.passes.schedule import schedule, width
from cortexc.pipeline import compile_source

FORMAT_VERSION = 1


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
    fields = asdict(step) if is_dataclass(step) else {}
    fields = {k: (v.value if hasattr(v, "value") else v) for k, v in fields.items()}
    return {"step": type(step).__name__.lower(), **fields}


def cell_spec(cell: Cell, program: Program, kernel_files: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": cell.name,
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
        "hoisted_widths": [width(cell.pre.values[i]) for _, i in cell.pre.results] if cell.pre else [],
        "packed": [
            {"name": w.name, "params": list(w.params), "m": w.m, "k": w.k, "transposed": list(w.transposed)}
            for w in program.packed
        ],
        "abi": abi(cell, program),
        "kernels": dict(kernel_files),
        "deferred": [
            {"rows": t["rows"], "m": t["m"], "k": t["k"], "param": t["param"]} for t in deferred_outer_products(program)
        ],
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


def write_package(
    source: str,
    source_file: str,
    out_dir: str | os.PathLike,
    defines: Mapping[str, int] | None = None,
    targets: tuple[str, ...] = ("c",),
    dump_dir: str | os.PathLike | None = None,
) -> Path:
    """Compile a `.cell` source into the package `out_dir/<stem>/`; returns its path."""
    for name in targets:
        if name not in TARGETS:
            raise CortexcError(f"target {name!r} is not available (available: {', '.join(TARGETS)})")
    cells = compile_source(source, source_file, defines, dump_dir)
    name = package_name(source_file)
    files: dict[str, str] = {}
    specs = []
    for cell in cells:
        program = schedule(cell)
        kernel_files, hashes = {}, {}
        for target_name in targets:
            target: Target = TARGETS[target_name]
            kernel_file = f"{cell.name}{target.source_suffix}"
            files[kernel_file] = render(program, target, source_file)
            kernel_files[target_name] = kernel_file
            hashes[target_name] = hashlib.sha256(files[kernel_file].encode()).hexdigest()
        spec = cell_spec(cell, program, kernel_files)
        spec["kernel_sha256"] = hashes
        specs.append(spec)
    description = {
        "format": FORMAT_VERSION,
        "cortexc": __version__,
        "package": name,
        "source_file": str(source_file),
        "source": source,
        "defines": dict(defines or {}),
        "cells": specs,
    }
    files["cell.json"] = json.dumps(description, indent=1, sort_keys=False) + "\n"
    files["__init__.py"] = (
        environment()
        .get_template("module_init.py.j2")
        .render(
            source_file=source_file,
            cell_names=[c.name for c in cells],
            kernel_files=[f for s in specs for f in s["kernels"].values()],
        )
    )
    return _install(Path(out_dir), name, files)


def _install(out: Path, name: str, files: dict[str, str]) -> Path:
    """Put the package in `out/name` whole or not at all; an identical package already there is kept as is.

    The files are written to a staging directory and renamed into place, so a
    reader never sees a half-written package, and concurrent writers of the
    same package (several processes calling `cortexc.load`) all succeed.
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
        if final.is_symlink() or final.is_file():
            final.unlink()
        elif final.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=out))
            with contextlib.suppress(FileNotFoundError):  # another writer may have moved it first
                os.replace(final, retired / name)
            shutil.rmtree(retired, ignore_errors=True)
        try:
            os.replace(staging, final)
        except OSError:
            if not _same_contents(final, files):  # a concurrent writer installed something else
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


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
