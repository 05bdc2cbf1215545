"""The generated package: `__init__.py` (from a template), kernel sources and `cell.json`.

`cell.json` (`cortexc.runtime.package`, the one typed format) describes every
cell: its runtime signature, the kernel ABI (the pointer layout the runtime
must pass) and per target its kernel file and hash, packed weights, deferred
terms, folds, saved arrays and schedule. That is all the runtime reads:
importing a package loads no compiler module. It also
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

from cortexc.codegen.render import environment, hoist_window
from cortexc.codegen.target import TARGETS, Target
from cortexc.errors import OutputError
from cortexc.ir.cell import Cell
from cortexc.ir.ops import Op
from cortexc.ir.program import KernelRole, Program, Rows, Store, StoreMode, StoreTarget, hoisted_widths
from cortexc.ir.runtime_signature import cell_signature
from cortexc.options import CompileOptions
from cortexc.runtime.abi import LaunchOptions
from cortexc.runtime.package import (
    AbiSpec,
    CellSpec,
    DeferredSpec,
    PackageSpec,
    SavedSpec,
    TargetSpec,
)
from cortexc.version import __version__

if TYPE_CHECKING:
    from cortexc.pipeline import Rendered


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


def hoisted_gradients_set(program: Program) -> tuple[bool, ...]:
    """Per hoisted array (the ABI's order): whether the backward SETs every row of its gradient before
    anything reads it, i.e. the node gradient kernel (run on every internal node, level by level) stores it
    with mode SET (`_GRADIENT_STORES` in the scheduler). A hoisted value with no gradient there (used only
    through non-differentiable ops) is stored by nobody, so the runtime zeroes its gradient rows first."""
    pre = program.cell.pre
    if pre is None:
        return ()
    stored = {
        step.name
        for kernel in program.kernels
        if kernel.role == KernelRole.GRAD_NODE and kernel.rows == Rows.LEVEL
        for step in kernel.steps
        if isinstance(step, Store) and step.target == StoreTarget.D_HOISTED and step.mode == StoreMode.SET
    }
    return tuple(name in stored for name, _ in pre.named_results)


def target_spec(program: Program, target: Target, kernel_file: str, text: str) -> TargetSpec:
    """What the executor of `target` needs to know of its program, beside its kernel file."""
    window = hoist_window(program, target)
    # a training forward may hoist by windows too where its backward reads no hoisted row (it then keeps none)
    training = hoist_window(program, target, training=True) if window is not None else None
    return TargetSpec(
        kernel_file=kernel_file,
        kernel_sha256=hashlib.sha256(text.encode()).hexdigest(),
        packed=program.packed,
        deferred=tuple(DeferredSpec(t.param, t.rows.value, t.m, t.k, t.narrow) for t in program.deferred or ()),
        folds=program.folds,
        saved=tuple(SavedSpec(v.name, v.width, v.internal) for v in program.saved),
        hoisted_window_rows=window["rows"] if window is not None else 0,
        training_window=training is not None,
        hoisted_gradients_set=hoisted_gradients_set(program),
        schedule=tuple(
            {
                "kernel": k.name,
                "rows": k.rows.value,
                "steps": [_step_json(s) for s in k.steps],
                "column_period": k.split.period if k.split is not None else None,
            }
            for k in program.kernels
        ),
    )


def cell_spec(cell: Cell, sections: Mapping[str, TargetSpec], launch: LaunchOptions) -> CellSpec:
    """A cell's entry of `cell.json`: its signature, its kernel ABI and each target's section."""
    return CellSpec(
        signature=cell_signature(cell),
        abi=AbiSpec(
            params=tuple(p.name for p in cell.params),
            inputs=tuple(i.name for i in cell.inputs),
            states=tuple(s.name for s in cell.states),
            hoisted=tuple(name for name, _ in cell.pre.named_results) if cell.pre is not None else (),
            outputs=tuple(o.name for o in cell.outputs),
        ),
        hoisted_widths=tuple(hoisted_widths(cell)),
        dropout_sites=len({v.attr("site") for body in cell.bodies() for v in body.values if v.op == Op.DROPOUT}),
        launch=launch,
        targets=dict(sections),
    )


def package_files(source: str, source_file: str, options: CompileOptions, rendered: Sequence[Rendered]) -> PackageFiles:
    """The files of the package of a compiled `.cell` file (nothing is written here)."""
    name = package_name(source_file)
    files: dict[str, str] = {}
    cells = []
    for item in rendered:
        programs = {v.target: v.program for v in item.programs}
        sections = {}
        for target_name, text in item.sources:
            kernel_file = f"{item.cell.name}{TARGETS[target_name].source_suffix}"
            if kernel_file in files:  # a second target of this suffix (a copied target's): its name in the file's
                kernel_file = f"{item.cell.name}.{target_name}{TARGETS[target_name].source_suffix}"
            files[kernel_file] = text
            sections[target_name] = target_spec(programs[target_name], TARGETS[target_name], kernel_file, text)
        cells.append(cell_spec(item.cell, sections, options.launch))
    description = PackageSpec(
        cortexc=__version__,
        package=name,
        source_file=str(source_file),
        source=source,
        defines=options.define_map,
        targets=tuple(options.targets),
        cells=tuple(cells),
    )
    files["cell.json"] = json.dumps(description.to_json(), indent=1, sort_keys=False) + "\n"
    files["__init__.py"] = (
        environment()
        .get_template("module_init.py.j2")
        .render(
            source_file=source_file,
            cell_names=[item.cell.name for item in rendered],
            kernel_files=[section.kernel_file for cell in cells for section in cell.targets.values()],
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
