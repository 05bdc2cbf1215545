"""The runtime signature of an IR cell (what the package's `cell.json` carries for the runtime)."""

from __future__ import annotations

from cortexc.ir.cell import Cell
from cortexc.runtime.signature import (
    CellSignature,
    InitSig,
    OutputSig,
    ParamSig,
    StructureSig,
)


def cell_signature(cell: Cell) -> CellSignature:
    """Declarations only: dims, params with their inits, inputs, states, outputs and the structure."""
    return CellSignature(
        name=cell.name,
        structure=StructureSig(cell.structure.value, cell.structure.shares_children, cell.arity),
        dims=cell.dims,
        params=tuple(ParamSig(p.name, p.shape, InitSig(p.init.kind.value, tuple(p.init.args))) for p in cell.params),
        inputs=cell.inputs,
        states=cell.states,
        outputs=tuple(OutputSig(o.name, o.shape, o.at_root) for o in cell.outputs),
    )
