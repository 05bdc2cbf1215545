"""The compiler as one ordered list of named stages.

`compile_source` parses, checks and lowers a `.cell` file, then runs every
pass of `PASSES` in order. Each pass is a pure `Cell -> Cell` function; the
IR verifier runs after lowering and after every pass, and with a dump
directory every stage is written as deterministic text
(`<cell>.<NN>-<stage>.ir`), which the golden tests compare.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cortexc.frontend import lower_source
from cortexc.ir.cell import Cell
from cortexc.ir.printer import format_cell
from cortexc.ir.verify import verify_cell
from cortexc.passes.autodiff import autodiff
from cortexc.passes.hoist import hoist
from cortexc.passes.specialize import specialize


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Cell], Cell]


#: the passes after lowering, in order
PASSES: tuple[Stage, ...] = (
    Stage("specialize", specialize),
    Stage("hoist", hoist),
    Stage("autodiff", autodiff),
)


def compile_source(
    source: str,
    file: str = "<string>",
    defines: Mapping[str, int] | None = None,
    dump_dir: str | os.PathLike | None = None,
) -> list[Cell]:
    """Every cell of the file through the whole pipeline (raises located errors)."""
    cells = lower_source(source, file, defines)
    compiled = []
    for cell in cells:
        stages = [("lower", verify_cell(cell, "lower"))]
        for stage in PASSES:
            cell = verify_cell(stage.run(cell), stage.name)
            stages.append((stage.name, cell))
        if dump_dir is not None:
            _dump(Path(dump_dir), stages)
        compiled.append(cell)
    return compiled


def compile_file(
    path: str | os.PathLike, defines: Mapping[str, int] | None = None, dump_dir: str | os.PathLike | None = None
) -> list[Cell]:
    source = Path(path).read_text(encoding="utf-8")
    return compile_source(source, str(path), defines, dump_dir)


def _dump(directory: Path, stages: list[tuple[str, Cell]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for number, (name, cell) in enumerate(stages):
        (directory / f"{cell.name}.{number:02d}-{name}.ir").write_text(format_cell(cell), encoding="utf-8")
