"""Inputs between the caller's rows and the kernels', and the edge values a `down` cell reads.

A caller gives an edge input as one row per edge in the forest's order (by parent id, then children order:
`Forest.edge_ptr`). The kernels read it per child edge, in their own order: the linearization's (levels of
parents) for a bottom-up cell, the reversed forest's for a `down` cell (`topdown`). `to_kernel_order` permutes
every edge input into that order before an executor sees it, and `from_kernel_order` puts their gradients back,
so no executor or target knows about edge order. A graph cell's kernels read every edge once per step: its
rows are tiled and their gradients summed (`runtime.graph`).

A `down` cell reads `edge.position` and `edge.siblings` of the edge to a node's parent, which the reversed
forest does not have (a parent's place there is another node's): the runtime gives them as two edge inputs of
its own (`InputSig.given_by`), computed here from the forest in its edge order, and never returned a gradient.
"""

from __future__ import annotations

import numpy as np

from cortexc.runtime.forest import Forest
from cortexc.runtime.graph import edge_order_steps
from cortexc.runtime.linearize import edge_order
from cortexc.runtime.signature import CellSignature
from cortexc.runtime.topdown import edge_order_down


def kernel_edge_order(signature: CellSignature, forest: Forest) -> np.ndarray:
    """For each child edge the cell's kernels walk, the forest's number of that edge (a graph cell's steps
    walk each edge once per step)."""
    if signature.structure.steps:
        return edge_order_steps(forest, signature.structure.steps)
    return edge_order_down(forest) if signature.structure.down else edge_order(forest)


def given_by_runtime(signature: CellSignature, forest: Forest) -> dict[str, np.ndarray]:
    """The edge inputs the runtime gives (`[E, 1]` float32, in the forest's edge order): each edge's child's
    place among its parent's children (``position``) and that parent's number of children (``siblings``)."""
    given = {}
    parents = forest.edge_parent
    for decl in signature.inputs:
        if decl.given_by == "position":
            values = np.arange(forest.num_edges, dtype=np.int64) - np.asarray(forest.edge_ptr)[parents]
        elif decl.given_by == "siblings":
            values = np.asarray(forest.num_children)[parents]
        else:
            continue
        given[decl.name] = np.ascontiguousarray(values.reshape(-1, 1), dtype=np.float32)
    return given


def to_kernel_order(signature: CellSignature, forest: Forest, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checked inputs plus the runtime's own, every edge input's rows in the kernels' child-edge order (copies;
    node inputs as they are: a graph cell's steps read the node's own row, `codegen.exprs.input_row`)."""
    on_edge = [i.name for i in signature.inputs if i.on_edge]
    if not on_edge:
        return inputs
    inputs = {**inputs, **given_by_runtime(signature, forest)}
    order = kernel_edge_order(signature, forest)
    return {name: np.ascontiguousarray(a[order]) if name in on_edge else a for name, a in inputs.items()}


def from_kernel_order(signature: CellSignature, forest: Forest, grads: dict) -> dict:
    """Gradients of the caller's edge inputs back in the forest's edge order (the inverse of `to_kernel_order`:
    a graph cell's rows of every step summed, in step order); the runtime's own inputs have none."""
    on_edge = [i.name for i in signature.inputs if i.on_edge]
    if not on_edge:
        return grads
    order = kernel_edge_order(signature, forest)
    for decl in signature.inputs:
        if decl.given_by:
            grads.pop(decl.name, None)
        elif decl.on_edge and decl.name in grads:
            grad = grads[decl.name]
            if len(order) == forest.num_edges:  # one row per edge: a permutation
                back = np.empty_like(grad)
                back[order] = grad
            elif forest.num_edges:  # a graph cell: each edge once per step, its rows consecutive per step
                back = grad.reshape(-1, forest.num_edges, *grad.shape[1:]).sum(axis=0)
            else:
                back = np.zeros((0, *grad.shape[1:]), dtype=grad.dtype)
            grads[decl.name] = np.ascontiguousarray(back)
    return grads
