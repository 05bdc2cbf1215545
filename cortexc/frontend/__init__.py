"""The front end: `.cell` text -> checked IR cells."""

from __future__ import annotations

from collections.abc import Mapping

from cortexc.frontend.check import ErrorSink, check_module
from cortexc.frontend.lower import lower_cell
from cortexc.frontend.parser import parse
from cortexc.ir.cell import Cell


def lower_source(source: str, file: str = "<string>", defines: Mapping[str, int] | None = None) -> list[Cell]:
    """Parse, check and lower every cell of a `.cell` file.

    Raises `CellSyntaxError`, `CellTypeError` or `DimError` (the first error,
    with every other one found in ``.others``).
    """
    module = parse(source, file)
    declared = check_module(module, defines)
    sink = ErrorSink()
    cells = [lower_cell(decl, sink, file) for decl in declared]
    sink.raise_if_any()
    return [cell for cell in cells if cell is not None]


__all__ = ["lower_source", "parse"]
