"""A deterministic text form of a scheduled `Program`, for `--dump-ir` and golden tests.

Each kernel is printed with its body, every value annotated with where it
lives (its `Place`), then its tile buffers and steps. Steps are printed from
their dataclass fields, so a new step kind or field shows up without a
printer change; fields that index the kernel's body print as ``%n``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from cortexc.ir.printer import format_value
from cortexc.ir.program import Kernel, Place, PlaceKind, Program

#: step fields that are indices of values of the kernel's body
VALUE_FIELDS = frozenset({"value", "operand", "a", "b", "index"})


def format_program(program: Program, title: str = "") -> str:
    cell = program.cell
    lines = [f"program {cell.name}{f' ({title})' if title else ''} {{"]
    for weight in program.packed:
        lines.append(f"  packed {_fields(weight)}")
    for name, offset, floats in program.accumulators:
        lines.append(f"  accumulator {name} offset={offset} floats={floats}")
    for field in dataclasses.fields(program):
        if field.name not in ("cell", "kernels", "packed", "accumulators"):
            lines.append(f"  {field.name} = {_text(getattr(program, field.name))}")
    for kernel in program.kernels:
        lines += _kernel(kernel)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _kernel(kernel: Kernel) -> list[str]:
    skip = ("name", "body", "places", "buffers", "steps", "split")
    head = " ".join(
        f"{f.name}={_text(getattr(kernel, f.name))}" for f in dataclasses.fields(kernel) if f.name not in skip
    )
    lines = [f"  kernel {kernel.name} {head} {{"]
    for index, (value, place) in enumerate(zip(kernel.body.values, kernel.places)):
        lines.append(f"    {format_value(index, value)}  @ {_place(place)}")
    results = ", ".join(f"{name} = %{index}" for name, index in kernel.body.results)
    lines.append(f"    -> {results}")
    for buffer in kernel.buffers:
        lines.append(f"    buffer {buffer.name} rows={buffer.rows.value} width={buffer.width}")
    split_steps = kernel.split.split_steps if kernel.split is not None else ()
    for number, step in enumerate(kernel.steps):
        mark = " [split]" if number < len(split_steps) and split_steps[number] else ""
        lines.append(f"    {type(step).__name__.lower()} {_fields(step)}{mark}")
    if kernel.split is not None:
        lines.append(f"    split period={kernel.split.period}")
    lines.append("  }")
    return lines


def _place(place: Place) -> str:
    if place.kind == PlaceKind.BUFFER:
        return f"{place.buffer}+{place.column}"
    return place.kind.value


def _fields(item: Any) -> str:
    parts = []
    for field in dataclasses.fields(item):
        value = getattr(item, field.name)
        parts.append(f"{field.name}=%{value}" if field.name in VALUE_FIELDS else f"{field.name}={_text(value)}")
    return " ".join(parts)


def _text(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__.lower()}({_fields(value)})"
    if isinstance(value, float):
        return repr(value)
    return str(value)
