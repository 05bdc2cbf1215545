"""The runtime signature of an IR cell (what the package's `cell.json` carries for the runtime)."""

from __future__ import annotations

from cortexc.ir.cell import Body, BodyKind, Cell
from cortexc.ir.ops import Op
from cortexc.runtime.signature import (
    CellSignature,
    EmbeddingSig,
    InitSig,
    OutputSig,
    ParamSig,
    StructureSig,
)


def cell_signature(cell: Cell) -> CellSignature:
    """Declarations only: dims, params with their inits, inputs, states, outputs and the structure."""
    return CellSignature(
        name=cell.name,
        structure=StructureSig(
            cell.structure.value, cell.structure.shares_children, cell.arity, cell.down, cell.steps or 0
        ),
        dims=cell.dims,
        params=tuple(ParamSig(p.name, p.shape, InitSig(p.init.kind.value, tuple(p.init.args))) for p in cell.params),
        inputs=cell.inputs,
        states=cell.states,
        outputs=tuple(OutputSig(o.name, o.shape, o.at_root) for o in cell.outputs),
        embeddings=embeddings(cell),
        positions=positions(cell),
    )


def positions(cell: Cell) -> tuple[tuple[str, int], ...]:
    """Each family whose matrices `W[edge.position] @ v` chooses by a child's position, with its number of
    matrices: the runtime refuses a forest with a node of more children (`check_forest`)."""
    found: dict[str, int] = {}
    for body in cell.bodies():
        for value in body.values:
            if value.op is Op.SELECT and value.attr("by") == "position":
                products = body.values[value.args[0]]  # reshape(matmul(param, v)), or reshape(param): W[edge.position]
                source = products
                while source.op != Op.PARAM:
                    source = body.values[source.args[0]]
                found[source.name] = products.shape[0]
    return tuple(sorted(found.items()))


def _rows_of(cell: Cell, body: Body) -> str:
    """The nodes a forward body runs for (`EmbeddingSig.rows`)."""
    if body.kind is BodyKind.LEAF:
        return "leaves"
    if body.kind in (BodyKind.PRE, BodyKind.NODE):
        return "internal" if cell.leaf is not None else "all"
    at_root = next(o.at_root for o in cell.outputs if o.body is body)
    return "roots" if at_root else "all"


def embeddings(cell: Cell) -> tuple[EmbeddingSig, ...]:
    """Params read only as look-up tables, each by an index input that indexes nothing else, with the
    nodes that look them up: what a sparse gradient of the table holds (from the forward bodies)."""
    tables: dict[str, set[str]] = {}  # param -> index inputs it is looked up by
    indexed: dict[str, set[str]] = {}  # index input -> params it looks up
    other_use: set[str] = set()  # params and inputs used otherwise
    rows: dict[str, set[str]] = {}
    for body in cell.bodies():
        for value in body.values:
            if value.op is Op.EMBED:
                table, looked_up = body.values[value.args[0]], body.values[value.args[1]]
                if table.op is Op.PARAM and looked_up.op is Op.INPUT:
                    tables.setdefault(table.name, set()).add(looked_up.name)
                    indexed.setdefault(looked_up.name, set()).add(table.name)
                    rows.setdefault(table.name, set()).add(_rows_of(cell, body))
                    continue
            for position, arg in enumerate(value.args):
                used = body.values[arg]
                if used.op in (Op.PARAM, Op.INPUT) and not (value.op is Op.EMBED and position < 2):
                    other_use.add(used.name)
    found = []
    for param in (p.name for p in cell.params):
        (index, *more) = sorted(tables.get(param, ())) or [""]
        if not index or more or param in other_use or index in other_use or indexed[index] != {param}:
            continue
        at = rows[param]
        if {"leaves", "internal"} <= at or "all" in at:
            at = {"all"}
        found.append(EmbeddingSig(param, index, tuple(sorted(at))))
    return tuple(found)
