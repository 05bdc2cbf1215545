"""`ForestBatch`: a linearised forest as the tensors the custom ops take, and a pytree node for `torch.export`.

Registered with torch's pytree, a batch flattens to its seven tensors and nothing else: the context is
empty, so no size of the forest it was traced with (and not the `Forest` itself, which only the eager
checks read) is baked into an exported program, and any other forest runs through it.
`ForestBatch.dynamic_shapes` gives every size a `torch.export.Dim`. A batch pickles as its tensors too
(`torch.export.save` keeps the example inputs, which `torch.export.load` reads with ``weights_only``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from cortexc.errors import InputError
from cortexc.runtime.forest import Forest
from cortexc.runtime.graph import edge_order_steps, linearize_steps
from cortexc.runtime.linearize import edge_order, linearize
from cortexc.runtime.topdown import edge_order_down, linearize_down
from cortexc.runtime.validate import checked_flag

#: the tensor fields, in the order the ops take the first six (`tensors`); all seven are the pytree's leaves
TENSOR_FIELDS = ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots", "internal", "edge_order")


@dataclass(frozen=True, eq=False)
class ForestBatch:
    """A linearised forest as int64 tensors (`runtime/linearize.py`): what the kernels walk.

    `internal` is the level-order tail of the nodes with children (its length sizes the hoisted rows,
    so that shapes follow from tensor sizes alone, as `torch.compile` needs); `roots` the roots in the
    forest's order; `edge_order`, for each child edge the kernels walk, the forest's number of that edge
    (`runtime.edges.kernel_edge_order`: where edge inputs are read, and a `down` cell's `edge.position`).
    A `down` cell's batch is of the reversed forest (`runtime.topdown`, ``down=True``), with the forest's
    roots. `forest` and `down` are kept to check the batch against a cell (in eager mode); a batch rebuilt
    from its pytree leaves has neither (the ops check what a compiled graph must).
    """

    level_order: Tensor
    level_ptr: Tensor
    edge_ptr: Tensor
    edge_child: Tensor
    roots: Tensor
    internal: Tensor
    edge_order: Tensor
    forest: Forest | None = field(default=None, repr=False)
    down: bool | None = field(default=None, repr=False)

    @classmethod
    def from_forest(cls, forest: Forest, steps: int = 0, down: bool = False) -> ForestBatch:
        """The batch a cell runs on; for a graph cell of T steps (``steps=T``) its T + 1 unrolled steps
        (`runtime.graph`: ``num_nodes`` is then (T + 1) times the graph's); for a `down` cell (``down=True``)
        the reversed forest, roots first (`runtime.topdown`). A module given a `Forest` makes its own."""
        if not isinstance(forest, Forest):
            raise InputError(f"ForestBatch.from_forest expects a cortexc.Forest, got {type(forest).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InputError(f"steps must be a non-negative int (a graph cell's T), got {steps!r}")
        down = checked_flag(down, "down")
        if down and steps:
            raise InputError("a batch is of a graph cell's steps or of a down cell's reversed forest, not both")
        if steps:
            lin, edges = linearize_steps(forest, steps), edge_order_steps(forest, steps)
        elif down:
            lin, edges = linearize_down(forest), edge_order_down(forest)
        else:
            lin, edges = linearize(forest), edge_order(forest)
        order = torch.tensor(lin.level_order)  # copies: the forest's arrays are read-only
        batch = cls(
            level_order=order,
            level_ptr=torch.tensor(lin.level_ptr),
            edge_ptr=torch.tensor(lin.edge_ptr),
            edge_child=torch.tensor(lin.edge_child),
            roots=torch.tensor(lin.roots),
            internal=order[lin.num_leaves :].clone(),  # its own tensor: a view would tie its size to a storage offset
            edge_order=torch.tensor(edges),
            forest=forest,
            down=down,
        )
        return batch.mark_dynamic()

    @property
    def num_nodes(self) -> int:
        return int(self.level_order.shape[0])

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the ops take, in their order (the module reads `edge_order` itself)."""
        return (self.level_order, self.level_ptr, self.edge_ptr, self.edge_child, self.roots, self.internal)

    def leaves(self) -> tuple[Tensor, ...]:
        """Every tensor, in `TENSOR_FIELDS` order: the pytree's leaves (``ForestBatch(*batch.leaves())``)."""
        return (*self.tensors(), self.edge_order)

    def mark_dynamic(self) -> ForestBatch:
        """Mark every size dynamic for `torch.compile` (`from_forest` does): forests of any size then share
        one graph, except where two sizes of the first forest were equal (dynamo gives them one symbol)."""
        for tensor in self.leaves():
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return self

    def __reduce__(self) -> tuple[Any, tuple[Tensor, ...]]:
        """Pickled as its tensors, as in its pytree (the ops check the structure from them): a saved program's
        example inputs then load under ``torch.load(weights_only=True)`` (`ForestBatch` is a safe global)."""
        return (ForestBatch, self.leaves())

    @staticmethod
    def dynamic_shapes(nodes: Any = None, edges: Any = None, prefix: str = "") -> list[dict[int, Any]]:
        """A batch's entry of `torch.export.export`'s ``dynamic_shapes``: every size a `torch.export.Dim`, so
        that forests of any size run through the exported program. Pass the `nodes` Dim to give the inputs'
        first dimension the same one (``{0: nodes}``), and the `edges` Dim for edge inputs; the level, root and
        internal-node counts get Dims of their own, named with `prefix` (Dims of one name are one size: two
        batches of a forest, a bottom-up and a `down` one, share nodes, edges and roots but not the others,
        so give the second ``prefix="down_"``). torch specialises a size of 0 or 1 in the example: export
        with a forest that has at least 2 of each (nodes, edges, levels, roots, nodes with children)."""
        dim = torch.export.Dim
        nodes = dim("nodes") if nodes is None else nodes
        edges = dim("edges") if edges is None else edges
        levels, roots, internal = dim(f"{prefix}levels"), dim(f"{prefix}roots"), dim(f"{prefix}internal")
        return [{0: nodes}, {0: levels + 1}, {0: nodes + 1}, {0: edges}, {0: roots}, {0: internal}, {0: edges}]


# ------------------------------------------------------------------------------------------------ pytree
def _flatten(batch: ForestBatch) -> tuple[list[Tensor], None]:
    return list(batch.leaves()), None


def _flatten_with_keys(batch: ForestBatch) -> tuple[list[tuple[Any, Tensor]], None]:
    return [(pytree.GetAttrKey(name), getattr(batch, name)) for name in TENSOR_FIELDS], None


def _unflatten(leaves: Any, context: None) -> ForestBatch:
    return ForestBatch(*leaves)


torch.serialization.add_safe_globals([ForestBatch])  # what `__reduce__` calls: it only stores its tensors
pytree.register_pytree_node(
    ForestBatch,
    _flatten,
    _unflatten,
    serialized_type_name="cortexc.torch.ForestBatch",  # what a saved program names the type by
    flatten_with_keys_fn=_flatten_with_keys,
)
