"""A deterministic text form of the IR, for `--dump-ir` and golden tests."""

from __future__ import annotations

from cortexc.ir.cell import Body, Cell, DType, Value
from cortexc.ir.ops import Domain, fmt_shape


def format_value(index: int, value: Value) -> str:
    args = ", ".join(f"%{a}" for a in value.args)
    attrs = " ".join(f"{k}={_attr(v)}" for k, v in value.attrs)
    head = f"%{index} = {value.op.value}"
    if args:
        head += f" {args}"
    if attrs:
        head += f" {attrs}"
    kind = f"{value.domain.name.lower()} {fmt_shape(value.shape)}"
    if value.dtype != DType.F32:
        kind += f" {value.dtype.value}"
    line = f"{head:<44} : {kind}"
    if value.label:
        line += f"  # {value.label}"
    return line


def _attr(value: object) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_body(title: str, body: Body, indent: str = "  ") -> list[str]:
    lines = [f"{indent}{title} {{"]
    lines += [f"{indent}  {format_value(i, v)}" for i, v in enumerate(body.values)]
    results = ", ".join(f"{name} = %{index}" for name, index in body.results)
    lines.append(f"{indent}  -> {results}")
    lines.append(f"{indent}}}")
    return lines


def format_cell(cell: Cell) -> str:
    arity = f"(arity = {cell.arity})" if cell.arity is not None else ""
    arity += f"(steps = {cell.steps})" if cell.steps is not None else ""
    arity += " down" if cell.down else ""
    lines = [f"cell {cell.name} on {cell.structure.value}{arity} {{"]
    lines += [f"  dim {name} = {value}" for name, value in cell.dims]
    for inp in cell.inputs:
        kind = f"index[{inp.index_range}]" if inp.is_index else fmt_shape(inp.shape)
        where = " on edge" if inp.on_edge else ""
        lines.append((f"  input {inp.name}{kind}" if not inp.is_index else f"  input {inp.name} : {kind}") + where)
    lines += [f"  param {p.name}{fmt_shape(p.shape)} init {p.init}" for p in cell.params]
    lines += [f"  state {s.name}{fmt_shape(s.shape)}" for s in cell.states]
    if cell.pre is not None:
        lines += format_body("pre (all internal nodes, before the recursion)", cell.pre)
    if cell.leaf is not None:
        lines += format_body("leaf", cell.leaf)
    lines += format_body("node", cell.node)
    for out in cell.outputs:
        where = " at root" if out.at_root else ""
        lines += format_body(f"output {out.name}{fmt_shape(out.shape)}{where}", out.body)
    if cell.grads is not None:
        lines.append("  # backward: the forward keeps every state of every node; each gradient body")
        lines.append("  # recomputes its node's forward values from those, then runs the adjoints")
        grads = cell.grads
        if grads.pre is not None:
            lines += format_body("grad pre", grads.pre)
        lines += format_body("grad leaf", grads.leaf)
        lines += format_body("grad node", grads.node)
        for out, body in zip(cell.outputs, grads.outputs):
            lines += format_body(f"grad output {out.name}", body)
    lines.append("}")
    return "\n".join(lines) + "\n"


def format_cells(cells: list[Cell]) -> str:
    return "\n".join(format_cell(cell) for cell in cells)


__all__ = ["format_cell", "format_cells", "format_body", "format_value", "Domain"]
