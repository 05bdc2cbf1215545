"""The compiler as one ordered list of named stages, from `.cell` source to a package.

`_stages()` is the whole compiler. Each stage is a pure function of its input
and the `CompileOptions`, with a docstring saying what it requires and
guarantees; a verifier runs after every stage, and with
``options.dump_dir`` every stage that has a text form writes it
(`<cell>.<NN>-<stage>.ir` for cells, `.prog` for scheduled programs), which
the golden tests compare. `compile_package` runs them all; `compile_source`
stops after the cell passes (for callers that want the IR).

    parse -> lower -> specialize -> hoist -> autodiff -> schedule
          -> target (per-target program passes) -> render (per target) -> package

The package stage only builds the files; `install_package` writes them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from cortexc.codegen.module import PackageFiles
from cortexc.frontend import ast
from cortexc.ir.cell import Cell
from cortexc.ir.printer import format_cell
from cortexc.ir.program import Program
from cortexc.ir.program_printer import format_program
from cortexc.ir.verify import verify_cell
from cortexc.ir.verify_program import verify_program
from cortexc.options import CompileOptions


@dataclass(frozen=True)
class Source:
    text: str
    file: str


@dataclass(frozen=True)
class TargetProgram:
    """A cell's program as one target runs it (after that target's program passes)."""

    target: str
    program: Program


@dataclass(frozen=True)
class Rendered:
    """A cell's kernel source per target."""

    cell: Cell
    programs: tuple[TargetProgram, ...]
    sources: tuple[tuple[str, str], ...]  # (target, source text)


@dataclass(frozen=True)
class Job:
    """What every stage may read besides its input: the source being compiled and the options."""

    source: Source
    options: CompileOptions


@dataclass(frozen=True)
class Stage:
    """One step of the compiler: `run` (pure), `verify` (returns its input or raises), `dump` (texts by name)."""

    name: str
    run: Callable[[Any, Job], Any]
    verify: Callable[[Any, str], Any]
    dump: Callable[[Any], dict[str, str]] | None = None


# ---------------------------------------------------------------- stages


def parse_stage(source: Source, job: Job) -> ast.Module:
    """Requires: any text. Guarantees: a syntactically valid module (else a located `CellSyntaxError`)."""
    from cortexc.frontend.parser import parse

    return parse(source.text, source.file)


def lower_stage(module: ast.Module, job: Job) -> tuple[Cell, ...]:
    """Requires: a parsed module. Guarantees: every cell checked (dims resolved with the options'
    defines, shapes, names, blocks) and lowered to verified SSA IR; else located errors, all of them."""
    from cortexc.frontend.check import ErrorSink, check_module
    from cortexc.frontend.lower import lower_cell

    declared = check_module(module, job.options.define_map)
    sink = ErrorSink()
    cells = [lower_cell(decl, sink, job.source.file) for decl in declared]
    sink.raise_if_any()
    return tuple(cell for cell in cells if cell is not None)


def _per_cell(function: Callable[[Cell], Cell]) -> Callable[[tuple[Cell, ...], Job], tuple[Cell, ...]]:
    """A `Cell -> Cell` pass as a stage over every cell of the file (its contract is its module's docstring)."""

    def run(cells: tuple[Cell, ...], job: Job) -> tuple[Cell, ...]:
        return tuple(function(cell) for cell in cells)

    run.__doc__ = sys.modules[function.__module__].__doc__
    return run


def schedule_stage(cells: tuple[Cell, ...], job: Job) -> tuple[Program, ...]:
    """Requires: specialised, hoisted, differentiated cells. Guarantees: one verified `Program` per cell
    (node batching and kernel fusion, see `cortexc.passes.schedule`), the same for every target."""
    from cortexc.passes.schedule import schedule

    return tuple(schedule(cell) for cell in cells)


def target_stage(programs: tuple[Program, ...], job: Job) -> tuple[tuple[TargetProgram, ...], ...]:
    """Requires: scheduled programs. Guarantees: per cell, one program per target of the options, after that
    target's own program passes (`Target.passes`, listed in its folder: for C saved activations, the direct
    node kernel, the column split, deferred weight gradients and folded look-ups; for CUDA the column split
    and deferred weight gradients)."""
    from cortexc.codegen.target import TARGETS

    per_cell = []
    for program in programs:
        variants = []
        for name in job.options.targets:
            variant = program
            for program_pass in TARGETS[name].passes:
                variant = program_pass(variant)
            variants.append(TargetProgram(name, variant))
        per_cell.append(tuple(variants))
    return tuple(per_cell)


def render_stage(programs: tuple[tuple[TargetProgram, ...], ...], job: Job) -> tuple[Rendered, ...]:
    """Requires: per-target programs. Guarantees: each rendered through the one Jinja2 skeleton for its
    `Target` (StrictUndefined: a template never sees a missing value)."""
    from cortexc.codegen.render import render
    from cortexc.codegen.target import TARGETS

    rendered = []
    for variants in programs:
        sources = tuple((v.target, render(v.program, TARGETS[v.target], job.source.file)) for v in variants)
        rendered.append(Rendered(variants[0].program.cell, variants, sources))
    return tuple(rendered)


def package_stage(rendered: tuple[Rendered, ...], job: Job) -> PackageFiles:
    """Requires: rendered kernels. Guarantees: the package's files: `__init__.py`, the kernels and `cell.json`
    (each cell's runtime signature, kernel ABI, launch schedule and kernel hashes), everything the runtime
    needs without the compiler."""
    from cortexc.codegen.module import package_files

    return package_files(job.source.text, job.source.file, job.options, rendered)


def _verify_cells(cells: tuple[Cell, ...], stage: str) -> tuple[Cell, ...]:
    return tuple(verify_cell(cell, stage) for cell in cells)


def _verify_programs(programs: tuple[Program, ...], stage: str) -> tuple[Program, ...]:
    return tuple(verify_program(program, stage) for program in programs)


def _verify_variants(per_cell: tuple[tuple[TargetProgram, ...], ...], stage: str) -> Any:
    for variants in per_cell:
        for variant in variants:
            verify_program(variant.program, f"{stage} ({variant.target})")
    return per_cell


def _verify_rendered(rendered: tuple[Rendered, ...], stage: str) -> tuple[Rendered, ...]:
    for item in rendered:
        for target, text in item.sources:
            if "cx_forward" not in text:
                raise RuntimeError(f"{stage}: the {target} source of {item.cell.name} has no entry point")
    return rendered


def _verify_package(package: PackageFiles, stage: str) -> PackageFiles:
    names = {name for name, _ in package.files}
    for required in ("__init__.py", "cell.json"):
        if required not in names:
            raise RuntimeError(f"{stage}: the package has no {required}")
    return package


def _dump_cells(cells: tuple[Cell, ...]) -> dict[str, str]:
    return {f"{cell.name}.ir": format_cell(cell) for cell in cells}


def _dump_programs(programs: tuple[Program, ...]) -> dict[str, str]:
    return {f"{p.cell.name}.prog": format_program(p) for p in programs}


def _dump_variants(per_cell: tuple[tuple[TargetProgram, ...], ...]) -> dict[str, str]:
    return {
        f"{v.program.cell.name}.{v.target}.prog": format_program(v.program, f"target {v.target}")
        for variants in per_cell
        for v in variants
    }


def _stages() -> tuple[Stage, ...]:
    from cortexc.passes.autodiff import autodiff
    from cortexc.passes.hoist import hoist
    from cortexc.passes.specialize import specialize

    return (
        Stage("parse", parse_stage, lambda module, _: module),
        Stage("lower", lower_stage, _verify_cells, _dump_cells),
        Stage("specialize", _per_cell(specialize), _verify_cells, _dump_cells),
        Stage("hoist", _per_cell(hoist), _verify_cells, _dump_cells),
        Stage("autodiff", _per_cell(autodiff), _verify_cells, _dump_cells),
        Stage("schedule", schedule_stage, _verify_programs, _dump_programs),
        Stage("target", target_stage, _verify_variants, _dump_variants),
        Stage("render", render_stage, _verify_rendered),
        Stage("package", package_stage, _verify_package),
    )


#: the cell passes, in order (after lowering): what `compile_source` runs
CELL_PASSES = ("specialize", "hoist", "autodiff")


def run_stages(source: Source, options: CompileOptions, until: str = "package") -> Any:
    """Run the stages in order up to and including `until`; verify and (with a dump dir) dump each."""
    stages = _stages()
    if until not in {s.name for s in stages}:
        raise ValueError(f"no stage named {until!r}")
    job = Job(source, options)
    result: Any = source
    number = 0
    for stage in stages:
        result = stage.run(result, job)
        result = stage.verify(result, stage.name)
        if stage.dump is not None:
            if options.dump_dir is not None:
                _write_dump(options.dump_dir, number, stage.name, stage.dump(result))
            number += 1
        if stage.name == until:
            break
    return result


def _write_dump(directory: Path, number: int, stage: str, texts: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        cell, _, suffix = name.partition(".")
        (directory / f"{cell}.{number:02d}-{stage}.{suffix}").write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- entry points


def compile_package(source: str, file: str, options: CompileOptions) -> PackageFiles:
    """The whole compiler: a `.cell` source to the files of its package (raises located errors)."""
    package: PackageFiles = run_stages(Source(source, file), options)
    return package


def write_package(source: str, file: str, out_dir: str | os.PathLike[str], options: CompileOptions) -> Path:
    """Compile and install the package into `out_dir/<name>/` (whole or not at all); returns its path."""
    from cortexc.codegen.module import install_package

    return install_package(Path(out_dir), compile_package(source, file, options))


def load_file(
    path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None, dims: Mapping[str, int]
) -> ModuleType:
    """`cortexc.load`: compile `path` (every target a backend of this machine may run) and import its
    package; the package goes to `out_dir`, or to the cache under the key of the source and options."""
    from cortexc.frontend.parser import read_source
    from cortexc.options import KNOWN_TARGETS
    from cortexc.runtime.build import cache_dir
    from cortexc.runtime.loader import import_package

    source = read_source(path)
    options = CompileOptions.make(dims, targets=KNOWN_TARGETS)
    if out_dir is None:
        out_dir = cache_dir() / "packages" / options.key(source, str(path))[:16]
    return import_package(write_package(source, str(path), out_dir, options))


def compile_source(
    source: str,
    file: str = "<string>",
    defines: Mapping[str, int] | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
) -> list[Cell]:
    """Every cell of the file through the front end and the cell passes (raises located errors)."""
    options = CompileOptions.make(defines, dump_dir=dump_dir)
    return list(run_stages(Source(source, file), options, until=CELL_PASSES[-1]))


def compile_file(
    path: str | os.PathLike[str],
    defines: Mapping[str, int] | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
) -> list[Cell]:
    from cortexc.frontend.parser import read_source

    source = read_source(path)
    return compile_source(source, str(path), defines, dump_dir)


def stage_names() -> tuple[str, ...]:
    return tuple(stage.name for stage in _stages())
