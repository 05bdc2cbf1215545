"""The top-down view of a forest, what a `down` cell runs on: every edge turned around.

A `down` cell computes a node after its parents and reads them through `parent`. Turned around, a node's
parents are its children: the reversed forest gives each node its parents as children, in increasing id
order (the order of `parent.s` on a DAG), so the roots become leaves and the leaves roots, and the
levels, kernels and executors of bottom-up cells run it unchanged (a node's state read by all of its
children is a child shared by several parents, whose gradient is added atomically). Read-outs at the root
are of the forest's own roots. Vectorised: a sort of the edges, no Python per node; computed once per
forest and kept in its `derived` like its linearization.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cortexc.runtime.csr import counts_to_ptr, gather_segments
from cortexc.runtime.forest import Forest
from cortexc.runtime.graph import linearize_steps
from cortexc.runtime.linearize import Linearized, linearize
from cortexc.runtime.signature import CellSignature


def reversed_forest(forest: Forest) -> Forest:
    """The forest with every edge turned around: node v's children are its parents, by increasing id."""
    cached = forest.derived.get("reversed")
    if cached is None:
        parents, children = forest.edge_parent, np.asarray(forest.edge_child, dtype=np.int64)
        by_child = np.lexsort((parents, children))  # each node's parents together, in increasing id order
        ptr = counts_to_ptr(np.bincount(children, minlength=forest.num_nodes).astype(np.int64))
        cached = Forest(ptr, parents[by_child])
        forest.derived["reversed"] = cached
        forest.derived["reversed_edges"] = by_child  # the reversed forest's edge j is the forest's edge by_child[j]
    return cached


def edge_order_down(forest: Forest) -> np.ndarray:
    """For each child edge the kernels of a `down` cell walk (the reversed forest's, `linearize_down`), the
    forest's number of that edge (`linearize.edge_order` for bottom-up cells)."""
    cached = forest.derived.get("edge_order_down")
    if cached is None:
        turned = reversed_forest(forest)
        ids = np.arange(turned.num_edges, dtype=np.int64)
        rows = gather_segments(turned.child_ptr, ids, np.asarray(turned.level_order, dtype=np.int64))
        cached = np.ascontiguousarray(forest.derived["reversed_edges"][rows], dtype=np.int64)
        cached.flags.writeable = False
        forest.derived["edge_order_down"] = cached
    return cached


def linearize_down(forest: Forest) -> Linearized:
    """The linearization a `down` cell runs on: the reversed forest's levels (roots first) and edges, with
    the forest's own roots (for outputs `at root`)."""
    cached = forest.derived.get("linearized_down")
    if cached is None:
        lin = linearize(reversed_forest(forest))
        roots = np.ascontiguousarray(forest.roots, dtype=np.int64)
        roots.flags.writeable = False
        cached = replace(lin, roots=roots)
        cached.addresses  # noqa: B018  # read once here, not per call
        forest.derived["linearized_down"] = cached
    return cached


def linearize_for(signature: CellSignature, forest: Forest, every_step: bool = True) -> Linearized:
    """What a cell runs on: the forest's linearization, for a `down` cell its reversed one, for a graph cell
    its unrolled steps (`runtime.graph`; without `every_step`, an inference's double-buffered ones)."""
    if signature.structure.steps:
        return linearize_steps(forest, signature.structure.steps, every_step)
    return linearize_down(forest) if signature.structure.down else linearize(forest)
