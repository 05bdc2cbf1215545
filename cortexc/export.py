"""`cortexc export`: a `.cell` file as a C library, a command-line program per cell and a Makefile.

A consumer of the pipeline: it runs the stages to the rendered C (`until="render"`, C target only) and
wraps each cell's kernels, unchanged, in a host side rendered from the `export_*` templates (params,
forest validation and linearisation, the forward; see `export_cell.c.j2`). It also writes the params
(`params.safetensors`) and what `make test` runs: a forest per cell with its inputs and the outputs the
reference interpreter computes for it, and bad forests and inputs with the messages the Python runtime
gives for them. The directory is written whole or not at all (a staging directory renamed into place).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cortexc.codegen.module import package_name
from cortexc.codegen.render import environment
from cortexc.errors import CortexcError, InputError
from cortexc.ir.cell import Cell
from cortexc.ir.ops import param_matrix
from cortexc.ir.program import Program, hoisted_widths
from cortexc.ir.runtime_signature import positions
from cortexc.options import CompileOptions
from cortexc.targets.c.target import TARGET as C_TARGET

#: the flags of the library and programs (as runtime/build.py's, for the same kernels and speed)
#: (the Makefile adds runtime/build.py's -mprefer-vector-width=512 where `uname -m` is an x86 one)
C_FLAGS = "-O3 -march=native -ffast-math -fopenmp -std=gnu11 -Wall -Wno-unused-function -Wno-unused-variable"
#: the flags of `make sanitize` (the `_run` programs built with AddressSanitizer and UBSan)
SANITIZE_FLAGS = (
    "-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -fopenmp -std=gnu11 "
    "-Wall -Wno-unused-function -Wno-unused-variable"
)


@dataclass(frozen=True)
class BadCase:
    """One input `make test` runs `<Cell>_run` on, expecting exit 1 and one stderr line (`message`, when
    the Python runtime gives one for the same input)."""

    name: str
    inputs: str  # the INPUTS file, relative to the export directory
    params: str
    outputs: str
    message: str | None


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape else ""


def cell_context(cell: Cell, program: Program, fold: bool = True) -> dict[str, Any]:
    """What the export templates read about one cell (names, shapes and the kernel ABI's orders); `fold`:
    whether its library builds the program's folded tables at load (`passes.fold`; `--no-fold` leaves none)."""
    param_index = {p.name: i for i, p in enumerate(cell.params)}
    shapes = {p.name: param_matrix(p.shape) for p in cell.params}  # as multiplied: a 3-D family's [R*M, K] rows
    packed = []
    for weight in program.packed:
        parts, row0 = [], 0
        for block_row in weight.block_rows():  # params side by side, each [rows, cols] as packed
            col0 = 0
            for name, flip in block_row:
                shape = shapes[name]
                rows, cols = (shape[-1], shape[0]) if flip else (shape[0], shape[-1])
                part = {"name": name, "index": param_index[name], "transposed": flip, "rows": rows, "cols": cols}
                parts.append({**part, "row0": row0, "col0": col0})
                col0 += cols
            row0 += rows
        packed.append({"m": weight.m, "k": weight.k, "parts": parts})
    states: list[dict[str, Any]] = [
        {"name": s.name, "shape": list(s.shape), "width": _width(s.shape), "shape_text": _shape_text(s.shape)}
        for s in cell.states
    ]
    outputs: list[dict[str, Any]] = [
        {
            "name": o.name,
            "shape": list(o.shape),
            "width": _width(o.shape),
            "at_root": o.at_root,
            "shape_text": _shape_text(o.shape),
        }
        for o in cell.outputs
    ]
    abi_inputs: list[dict[str, Any]] = [
        {
            "name": i.name,
            "is_index": i.is_index,
            "shape": list(i.shape),
            "width": _width(i.shape),
            "index_range": i.index_range,
            "shape_text": _shape_text(i.shape),
            "on_edge": i.on_edge,
            "given_by": i.given_by,
            "abi_index": index,
        }
        for index, i in enumerate(cell.inputs)
    ]
    return {
        "name": cell.name,
        "upper": cell.name.upper(),
        "structure": cell.structure.value,
        "arity": cell.arity,
        "is_dag": cell.structure.shares_children,
        "steps": cell.steps,
        "dims": list(cell.dims),
        "params": [
            {
                "name": p.name,
                "shape": list(p.shape),
                "size": int(np.prod(p.shape, dtype=np.int64)),
                "shape_text": _shape_text(p.shape),
            }
            for p in cell.params
        ],
        "max_param_ndim": max((len(p.shape) for p in cell.params), default=1) or 1,
        "inputs": [i for i in abi_inputs if not i["given_by"]],  # the caller's
        "abi_inputs": abi_inputs,  # the kernels' (a down cell's edge.position / edge.siblings too)
        "down": cell.down,
        "positions": [{"family": family, "count": count} for family, count in positions(cell)],
        "states": states,
        "outputs": outputs,
        "results": [{**s, "kind": "state", "at_root": False} for s in states]
        + [{**o, "kind": "output"} for o in outputs],
        "packed": packed,
        "folds": [
            {
                "name": f.name,
                "table": f.table,
                "weights": ", ".join(next(w.params for w in program.packed if w.name == f.packed)),
                "rows": f.rows,
                "m": f.m,
                "bytes": 4 * f.rows * f.m,
            }
            for f in (program.folds if fold else ())
        ],
        "folds_compiled": len(program.folds),
        "hoisted_widths": hoisted_widths(cell),
    }


def _width(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def export(
    cell_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    defines: Mapping[str, int] | None = None,
    params_file: str | os.PathLike[str] | None = None,
    fold: bool = True,
) -> Path:
    """Write `out_dir/<stem>/` for the cells of `cell_file`; returns its path. `fold=False` (`--no-fold`):
    the libraries never build folded tables (the kernels keep their GEMMs, `cx_call.folded` stays NULL)."""
    from cortexc.pipeline import Source, run_stages

    source = Path(cell_file).read_text(encoding="utf-8")
    options = CompileOptions.make(defines, (C_TARGET.name,))  # a served package is C
    rendered = run_stages(Source(source, str(cell_file)), options, until="render")
    stem = package_name(cell_file)
    cells = [item.cell for item in rendered]
    params = _params(cells, params_file)
    env = environment()
    text_files: dict[str, str] = {}
    binary: dict[str, dict[str, np.ndarray]] = {}
    cases: dict[str, list[BadCase]] = {}
    prefixed = len(cells) > 1
    stored: dict[str, np.ndarray] = {}
    for item in rendered:
        cell = item.cell
        program = next(v.program for v in item.programs if v.target == C_TARGET.name)
        context = {"c": cell_context(cell, program, fold), "source_file": str(cell_file)}  # the templates' name
        kernels = dict(item.sources)[C_TARGET.name]
        text_files[f"{cell.name}.h"] = env.get_template("export_header.h.j2").render(**context)
        text_files[f"{cell.name}.c"] = env.get_template("export_cell.c.j2").render(**context, kernels=kernels)
        text_files[f"{cell.name}_io.h"] = env.get_template("export_io.h.j2").render(**context)
        text_files[f"{cell.name}_run.c"] = env.get_template("export_run.c.j2").render(**context)
        text_files[f"{cell.name}_check.c"] = env.get_template("export_check.c.j2").render(**context)
        for name, value in params[cell.name].items():
            stored[f"{cell.name}.{name}" if prefixed else name] = value
        test_files, cell_cases = _test_data(cell, params[cell.name])
        binary.update(test_files)
        cases[cell.name] = cell_cases
        for case in cell_cases:
            if case.message is not None:
                text_files[f"test/{cell.name}.bad_{case.name}.expected_err"] = case.message + "\n"
    binary["params.safetensors"] = stored
    text_files["cx_safetensors.h"] = env.get_template("export_safetensors.h.j2").render()
    names = [cell.name for cell in cells]
    text_files["Makefile"] = env.get_template("export_makefile.j2").render(
        stem=stem,
        cells=names,
        source_file=str(cell_file),
        c_flags=C_FLAGS,
        sanitize_flags=SANITIZE_FLAGS,
    )
    text_files["test/run_tests.sh"] = env.get_template("export_tests.sh.j2").render(
        cells=names, cases=cases, source_file=str(cell_file)
    )
    return _write_directory(Path(out_dir), stem, text_files, binary)


def _params(cells: list[Cell], params_file: str | os.PathLike[str] | None) -> dict[str, dict[str, np.ndarray]]:
    """Each cell's params: from `params_file` (prefixed `<Cell>.` names in a file of several cells), else
    those of `Cell(seed=0)`."""
    from cortexc.ir.runtime_signature import cell_signature
    from cortexc.runtime.params import check_params, init_params, read_params_file

    signatures = {cell.name: cell_signature(cell) for cell in cells}
    if params_file is None:
        return {name: init_params(sig, 0) for name, sig in signatures.items()}
    given = read_params_file(params_file)
    if len(cells) == 1:
        ((name, sig),) = signatures.items()
        return {name: check_params(sig, given)}
    split: dict[str, dict[str, np.ndarray]] = {name: {} for name in signatures}
    for key, value in given.items():
        cell_name, dot, param = key.partition(".")
        if not dot or cell_name not in split:
            raise InputError(
                f"{params_file}: param {key!r} is not named <Cell>.<param> for a cell of the file "
                f"({', '.join(signatures)})"
            )
        split[cell_name][param] = value
    return {name: check_params(sig, split[name]) for name, sig in signatures.items()}


def _test_forest(cell: Cell) -> Any:
    from cortexc.runtime.forest import Forest

    if cell.steps is not None:  # a graph: cycles, a self-loop, a repeated edge, an isolated node
        rng = np.random.default_rng(0)
        src = np.concatenate([np.arange(12), rng.integers(0, 15, 20), [3, 5]])
        dst = np.concatenate([(np.arange(12) + 1) % 12, rng.integers(0, 15, 20), [3, 5]])
        keep = (src != 15) & (dst != 15)
        return Forest.from_edges(src[keep], dst[keep], num_nodes=16)
    if cell.structure.shares_children:
        return Forest.random_dag(24, rng=0, max_children=cell.arity or 3)
    return Forest.random(4, rng=0, binary=cell.arity == 2, max_children=cell.arity or 3, max_nodes=13)


def _forest_tensors(forest: Any) -> dict[str, np.ndarray]:
    if forest.is_tree and forest.cycle is None:
        return {"parents": forest.parents.astype(np.int32)}
    return {"children_ptr": forest.child_ptr.astype(np.int32), "children": forest.child_idx.astype(np.int32)}


def _test_data(cell: Cell, params: Mapping[str, np.ndarray]) -> tuple[dict[str, dict[str, np.ndarray]], list[BadCase]]:
    """A forest, its inputs and the interpreter's outputs; bad inputs with the Python runtime's messages."""
    from cortexc import reference
    from cortexc.runtime.forest import Forest
    from cortexc.runtime.validate import check_forest, check_inputs

    rng = np.random.default_rng(0)
    forest = _test_forest(cell)
    inputs = {}
    for decl in cell.inputs:
        if decl.given_by:  # a down cell's edge.position / edge.siblings: the library computes them
            continue
        rows = forest.num_edges if decl.on_edge else forest.num_nodes
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, rows).astype(np.int32)
        else:
            inputs[decl.name] = rng.standard_normal((rows, *decl.shape)).astype(np.float32)
    on_edge = {decl.name for decl in cell.inputs if decl.on_edge}

    def _rows(inputs: Mapping[str, np.ndarray], n: int, edges: int) -> dict[str, np.ndarray]:
        """n rows of every node input and `edges` of every edge input (the test's rows, repeated as needed)."""
        return {
            name: np.ascontiguousarray(value[np.arange(edges if name in on_edge else n) % max(len(value), 1)])
            for name, value in inputs.items()
        }

    expected = reference.run(cell, forest, params, inputs)
    files = {
        f"test/{cell.name}.inputs.safetensors": {**_forest_tensors(forest), **inputs},
        f"test/{cell.name}.expected.safetensors": {k: np.asarray(v, np.float32) for k, v in expected.items()},
    }
    cases: list[BadCase] = []

    def bad(name: str, tensors: dict[str, np.ndarray], build: Any) -> None:
        """A bad INPUTS file and the message the Python runtime gives for the same forest and inputs."""
        try:
            built = build()
            check_forest(cell, built)
            check_inputs(
                cell, built, {k: v for k, v in tensors.items() if k not in ("parents", "children_ptr", "children")}
            )
        except CortexcError as err:
            message: str | None = f"{cell.name}_run: {err}"
        else:
            raise AssertionError(f"export: the bad case {name} of {cell.name} is accepted by the runtime")
        path = f"test/{cell.name}.bad_{name}.safetensors"
        files[path] = tensors
        cases.append(BadCase(name, path, "params.safetensors", "test/bad.out.safetensors", message))

    if cell.steps is None:  # a graph cell takes cycles
        cycle_ptr = np.array([0, 1, 2, 2], np.int64)
        cycle_idx = np.array([1, 0], np.int64)
        bad(
            "cycle",
            {"children_ptr": cycle_ptr.astype(np.int32), "children": cycle_idx.astype(np.int32), **_rows(inputs, 3, 2)},
            lambda: Forest(cycle_ptr, cycle_idx),
        )
    parents = np.array([-1, 0, 0, 5, 1], np.int32)
    bad("parent_range", {"parents": parents, **_rows(inputs, 5, 4)}, lambda: Forest.from_parents(parents))
    if not cell.structure.shares_children:
        ptr, idx = np.array([0, 0, 1, 2], np.int64), np.array([0, 0], np.int64)
        bad(
            "two_parents",
            {"children_ptr": ptr.astype(np.int32), "children": idx.astype(np.int32), **_rows(inputs, 3, 2)},
            lambda: Forest(ptr, idx),
        )
    if cell.arity is not None:
        wide = np.array([-1] + [0] * (cell.arity + 1), np.int32)
        bad("arity", {"parents": wide, **_rows(inputs, wide.size, wide.size - 1)}, lambda: Forest.from_parents(wide))
    chain = np.array([-1, 0, 1], np.int32)
    for decl in cell.inputs:  # the chain: 3 nodes, 2 edges
        if decl.given_by:
            continue
        if decl.is_index:
            rows = _rows(inputs, 3, 2)
            rows[decl.name] = np.array([0, decl.index_range, 0][: len(rows[decl.name])], np.int32)
            bad(f"{decl.name}_range", {"parents": chain, **rows}, lambda: Forest.from_parents(chain))
        else:
            rows = _rows(inputs, 3, 2)
            rows[decl.name] = rows[decl.name][:-1]
            bad(f"{decl.name}_rows", {"parents": chain, **rows}, lambda: Forest.from_parents(chain))
    prefix = f"test/{cell.name}"
    cases.append(
        BadCase(
            "missing_inputs",
            f"{prefix}.no_such_file.safetensors",
            "params.safetensors",
            "test/bad.out.safetensors",
            None,
        )
    )
    cases.append(
        BadCase(
            "truncated_params",
            f"{prefix}.inputs.safetensors",
            "test/truncated.safetensors",
            "test/bad.out.safetensors",
            None,
        )
    )
    cases.append(
        BadCase(
            "unwritable_outputs",
            f"{prefix}.inputs.safetensors",
            "params.safetensors",
            "test/no/such/dir/out.safetensors",
            None,
        )
    )
    return files, cases


def _write_directory(
    out: Path, stem: str, text_files: Mapping[str, str], binary: Mapping[str, Mapping[str, np.ndarray]]
) -> Path:
    """Write the files into `out/<stem>` whole or not at all (a staging directory renamed into place)."""
    from cortexc.runtime import safetensors

    out.mkdir(parents=True, exist_ok=True)
    final = out / stem
    staging = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=out))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
        (staging / "test").mkdir()
        for name, text in text_files.items():
            (staging / name).write_text(text, encoding="utf-8")
        for name, tensors in binary.items():
            safetensors.save(staging / name, tensors)
        params = (staging / "params.safetensors").read_bytes()
        (staging / "test" / "truncated.safetensors").write_bytes(params[: min(len(params) // 2, 4096)])
        if final.exists() or final.is_symlink():
            if final.is_dir() and not final.is_symlink():
                retired = Path(tempfile.mkdtemp(prefix=f".{stem}-old-", dir=out))
                os.replace(final, retired / stem)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                final.unlink()
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
