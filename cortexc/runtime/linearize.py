"""A forest as the flat arrays the generated code walks: levels and level-ordered child edges.

`Forest` already has ``level_order``/``level_ptr``; the kernels also need,
for every level-order position, its children as one contiguous edge range
(``edge_ptr``/``edge_child``), so a tile of consecutive nodes of a level has
consecutive child edges. Vectorised: no Python per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    @property
    def num_leaves(self) -> int:
        return int(self.level_ptr[1]) if self.num_levels else 0


def linearize(forest: Forest) -> Linearized:
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
        level_order=order,
        level_ptr=level_ptr,
        edge_ptr=edge_ptr,
        edge_child=edge_child,
        roots=np.ascontiguousarray(forest.roots, dtype=np.int64),
    )
