"""A forest as the flat arrays the generated code walks: levels and level-ordered child edges.

`Forest` already has ``level_order``/``level_ptr``; the kernels also need,
for every level-order position, its children as one contiguous edge range
(``edge_ptr``/``edge_child``), so a tile of consecutive nodes of a level has
consecutive child edges. Vectorised: no Python per node.

A forest is immutable, so its linearization is computed once and kept in the forest's `derived` (not
pickled): a model called again and again on one forest (a benchmark, a serving loop, an epoch over
fixed batches) pays for it once. Its arrays are read-only like the forest's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cortexc.errors import ForestError
from cortexc.runtime.csr import counts_to_ptr, gather_segments
from cortexc.runtime.forest import Forest


@dataclass(frozen=True)
class Linearized:
    num_nodes: int
    num_levels: int
    max_children: int
    level_order: np.ndarray  # int64 [N]
    level_ptr: np.ndarray  # int64 [num_levels + 1]
    edge_ptr: np.ndarray  # int64 [N + 1], by level-order position
    edge_child: np.ndarray  # int64 [E]
    roots: np.ndarray  # int64 [num_roots]
    step_nodes: int = 0  # a graph cell's unrolled steps: the nodes of one step (`prev` of node n is n - step_nodes)
    state_rows: int = 0  # the states' rows the node ids address (0: num_nodes; a graph inference's steps: 2 N)

    def __post_init__(self) -> None:
        if not self.state_rows:
            object.__setattr__(self, "state_rows", self.num_nodes)

    @property
    def num_leaves(self) -> int:
        return int(self.level_ptr[1]) if self.num_levels else 0

    @cached_property
    def widest_internal_level(self) -> int:
        """The most nodes of one level above the leaves (0 when there is none)."""
        sizes = np.diff(self.level_ptr[1:])
        return int(sizes.max()) if len(sizes) else 0

    @cached_property
    def addresses(self) -> tuple[int, int, int, int, int]:
        """The addresses of level_order, level_ptr, edge_ptr, edge_child and roots (the `cx_call` order),
        read once: the arrays live as long as this value."""
        arrays = (self.level_order, self.level_ptr, self.edge_ptr, self.edge_child, self.roots)
        return tuple(a.ctypes.data for a in arrays)  # type: ignore[return-value]


def linearize(forest: Forest) -> Linearized:
    """The forest's linearization (computed on the first call for this forest object, then kept on it).

    Threads that race on a new forest each compute an equal value and one of them is kept: no lock needed."""
    cached = forest.derived.get("linearized")
    if cached is None:
        if forest.cycle is not None:
            raise ForestError(f"{forest.cycle}: a forest with cycles has no levels (only graph cells run on it)")
        cached = _linearize(forest)
        cached.addresses  # noqa: B018  # read once here, not per call
        forest.derived["linearized"] = cached
    return cached


def _linearize(forest: Forest) -> Linearized:
    order = np.ascontiguousarray(forest.level_order, dtype=np.int64)
    edge_ptr = counts_to_ptr(np.asarray(forest.num_children, dtype=np.int64)[order])
    edge_child = np.ascontiguousarray(gather_segments(forest.child_ptr, forest.child_idx, order), dtype=np.int64)
    level_ptr = np.ascontiguousarray(forest.level_ptr, dtype=np.int64)
    if forest.num_nodes == 0:
        level_ptr = np.zeros(2, dtype=np.int64)
    return Linearized(
        num_nodes=forest.num_nodes,
        num_levels=max(forest.num_levels, 1),
        max_children=int(forest.max_children),
        level_order=readonly(order),
        level_ptr=readonly(level_ptr),
        edge_ptr=readonly(edge_ptr),
        edge_child=readonly(edge_child),
        roots=readonly(np.ascontiguousarray(forest.roots, dtype=np.int64)),
    )


def edge_order(forest: Forest) -> np.ndarray:
    """For each of the kernels' child edges (`Linearized.edge_child`'s order: by the parent's level-order
    position), the forest's number of that edge (by parent id, `Forest.edge_ptr`): where edge inputs,
    given in the forest's order, are read from. Kept on the forest like its linearization."""
    cached = forest.derived.get("edge_order")
    if cached is None:
        ids = np.arange(forest.num_edges, dtype=np.int64)
        order = np.asarray(forest.level_order, dtype=np.int64)
        cached = readonly(np.ascontiguousarray(gather_segments(forest.child_ptr, ids, order), dtype=np.int64))
        forest.derived["edge_order"] = cached
    return cached


def readonly(array: np.ndarray) -> np.ndarray:
    """A read-only view over a read-only base (kept for every later call: no one may make it writeable)."""
    array.flags.writeable = False
    view = array.view()
    view.flags.writeable = False
    return view
