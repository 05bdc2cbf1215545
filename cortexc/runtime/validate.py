"""Checks of a forest and its inputs against a cell, before anything runs.

Malformed input never reaches a kernel: row counts, dtypes and index ranges
are checked here, vectorised, and the first offending node is named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from cortexc.errors import ForestError, InputError
from cortexc.runtime.forest import Forest
from cortexc.runtime.signature import CellSignature


class HasSignature(Protocol):
    """What the checks take besides a signature: a compiler-side cell (the IR's `Cell`), which makes its own
    (so the runtime imports nothing of the IR)."""

    def signature(self) -> CellSignature: ...


#: a cell as the checks and the params take it
AnyCell = CellSignature | HasSignature


def signature(cell: AnyCell) -> CellSignature:
    """The runtime signature of a cell given as a signature or (by compiler-side callers) as IR."""
    return cell if isinstance(cell, CellSignature) else cell.signature()


def checked_flag(value: object, name: str) -> bool:
    """A flag argument (`grad`, `train`, `host`, `sparse`, `fold`) as a bool, else an `InputError`: a string
    such as ``"no"`` is truthy in Python and would silently turn the flag on."""
    if not isinstance(value, bool | np.bool_):
        raise InputError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def as_array(value: object, what: str) -> np.ndarray:
    """`value` as a NumPy array, or an `InputError` naming `what`: a torch tensor that requires grad
    (torch refuses to give its memory to NumPy) and objects NumPy cannot read get one too."""
    if getattr(value, "requires_grad", False) is True:
        raise InputError(
            f"{what} is a torch tensor that requires grad: the NumPy API tracks no gradients "
            "(pass tensor.detach(), or run the cell as a cortexc.torch.CellModule)"
        )
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise InputError(f"{what} cannot be read as an array ({type(err).__name__}: {err})") from None


def check_forest(cell: AnyCell, forest: Forest) -> None:
    sig = signature(cell)
    if not isinstance(forest, Forest):
        raise InputError(f"expected a cortexc.Forest, got {type(forest).__name__}")
    if sig.structure.steps:  # a graph cell runs on any graph: cycles, self-loops, repeated edges
        return
    forest.check_structure(is_dag=sig.structure.shares_children, arity=sig.arity, cell_name=sig.name)
    for family, count in sig.positions:  # W[edge.position] chooses among `count` matrices
        if forest.num_nodes and int(forest.max_children) > count:
            node = int(np.flatnonzero(np.asarray(forest.num_children) > count)[0])
            raise ForestError(
                f"node {node} has {int(forest.num_children[node])} children, but {family}[edge.position] of cell "
                f"{sig.name} chooses among {count} matrices (positions 0 to {count - 1})"
            )


def edge_text(forest: Forest, edge: int) -> str:
    """An edge as messages name it: its number and its two nodes."""
    parent = int(np.searchsorted(forest.edge_ptr, edge, side="right")) - 1
    return f"edge {edge} (node {int(forest.edge_child[edge])} -> node {parent})"


def check_inputs(
    cell: AnyCell, forest: Forest, inputs: Mapping[str, object], dtype: type = np.float32
) -> dict[str, np.ndarray]:
    """The inputs as contiguous arrays: float ones as `dtype` `[N, X]`, index ones as int32 `[N]`."""
    cell = signature(cell)
    declared = {decl.name: decl for decl in cell.inputs if not decl.given_by}  # the runtime gives the others
    unknown = sorted(set(inputs) - set(declared))
    if unknown:
        raise InputError(
            f"cell {cell.name} has no input {', '.join(repr(u) for u in unknown)} "
            f"(its inputs: {', '.join(declared) or 'none'})"
        )
    missing = [name for name in declared if name not in inputs]
    if missing:
        raise InputError(f"missing input {', '.join(repr(m) for m in missing)} for cell {cell.name}")
    checked: dict[str, np.ndarray] = {}
    for name, decl in declared.items():
        array = as_array(inputs[name], f"input {name}")
        n, rows = (forest.num_edges, "edge") if decl.on_edge else (forest.num_nodes, "node")
        if decl.is_index:
            if array.shape != (n,):
                raise InputError(f"input {name} must have shape ({n},) (one index per {rows}), got {array.shape}")
            if array.dtype.kind not in "iu":  # np.integer's kinds (a bool array is not one)
                raise InputError(f"input {name} is an index input and must be integers, got dtype {array.dtype}")
            # two reductions say whether any index is out of range; only then look for the first one
            limit = decl.index_range or 0  # set for every index input
            if n and (int(array.min()) < 0 or int(array.max()) >= limit):
                bad = np.flatnonzero((array < 0) | (array >= decl.index_range))
                first = int(bad[0])
                where = f"node {first}" if not decl.on_edge else edge_text(forest, first)
                raise InputError(
                    f"input {name}: {where} has index {int(array[first])}, outside "
                    f"[0, {decl.index_range}) ({bad.size} {rows}s out of range)"
                )
            checked[name] = np.ascontiguousarray(array, dtype=np.int32)
        else:
            expected = (n, *decl.shape)
            if array.shape != expected:
                raise InputError(f"input {name} must have shape {expected} (one row per {rows}), got {array.shape}")
            if array.dtype.kind != "f":  # np.floating's kind
                raise InputError(f"input {name} must be float32, got dtype {array.dtype}")
            checked[name] = np.ascontiguousarray(array, dtype=dtype)
    return checked
