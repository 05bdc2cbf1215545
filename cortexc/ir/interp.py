"""The reference interpreter's rules: the executable meaning of every IR op, for one node.

`eval_body` evaluates a body for one node (a `NodeView`: its index, its
children, the states, inputs and params). Walking a forest, children before
parents, is the runtime's (`cortexc.reference`), which also
validates the forest and inputs, once. Together they are the oracle every
compiled path is compared with and the "eager" baseline of the benchmarks,
so they favour being obviously right over being fast.

Array layout: a per-node value has its own shape (`[H]`, `[H, H]`); a
per-child value has one more leading axis, the children (`[num_children, H]`).
A node without children has zero-row per-child values, so `sum` gives 0
with no special case; `mean` and `max` of no children are defined as 0.
"""

from __future__ import annotations

import numpy as np

from cortexc.ir.cell import Body, Value
from cortexc.ir.ops import OPS
from cortexc.runtime.philox import EVAL, Dropout


class NodeView:
    """What the rules of one node can see."""

    __slots__ = (
        "index",
        "children",
        "prev",
        "input_row",
        "edges",
        "states",
        "inputs",
        "params",
        "dtype",
        "hoisted",
        "adjoints",
        "saved",
        "dropout",
    )

    def __init__(
        self,
        index,
        children,
        states,
        inputs,
        params,
        dtype,
        dropout: Dropout = EVAL,
        edges=None,
        prev: int = -1,
        input_row: int | None = None,
    ):
        self.index = index
        self.children = children
        self.prev = prev  # a graph cell's node after step 0: its row one step earlier
        self.input_row = index if input_row is None else input_row  # a graph cell's: the node's own at any step
        self.edges = edges  # the rows of the edges to the children in the edge inputs' (linearized) order
        self.states = states
        self.inputs = inputs
        self.params = params
        self.dtype = dtype
        self.hoisted: dict[str, np.ndarray] = {}  # this node's results of the cell's `pre` body
        self.adjoints: dict[str, np.ndarray] = {}  # incoming gradients, for gradient bodies
        self.saved: dict[str, np.ndarray] = {}  # the flat row a training forward kept, by its name (`saved`)
        self.dropout = dropout  # the call's dropout mode (training: masks by seed and element identity)


def eval_value(value: Value, args: list[np.ndarray], arg_values: list[Value], node: NodeView) -> np.ndarray:
    """The rule of one op: its registry entry's interpreter rule."""
    return OPS[value.op].interp(node, value, args, arg_values)


def eval_body(body: Body, node: NodeView) -> list[np.ndarray]:
    results: list[np.ndarray] = []
    for value in body.values:
        args = [results[a] for a in value.args]
        arg_values = [body.values[a] for a in value.args]
        results.append(eval_value(value, args, arg_values, node))
    return results
