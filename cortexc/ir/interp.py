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

from typing import Any

import numpy as np

from cortexc.ir.cell import Body, Value
from cortexc.ir.ops import OPS, Domain, Identity, Op, OpKind
from cortexc.runtime.philox import EVAL, Dropout


class NodeView:
    """What the rules of one node can see."""

    __slots__ = ("index", "children", "states", "inputs", "params", "dtype", "hoisted", "adjoints", "saved", "dropout")

    def __init__(self, index, children, states, inputs, params, dtype, dropout: Dropout = EVAL):
        self.index = index
        self.children = children
        self.states = states
        self.inputs = inputs
        self.params = params
        self.dtype = dtype
        self.hoisted: dict[str, np.ndarray] = {}  # this node's results of the cell's `pre` body
        self.adjoints: dict[str, np.ndarray] = {}  # incoming gradients, for gradient bodies
        self.saved: dict[str, np.ndarray] = {}  # the flat row a training forward kept, by its name (`saved`)
        self.dropout = dropout  # the call's dropout mode (training: masks by seed and element identity)


def _batched(x: np.ndarray, value: Value, rank: int) -> np.ndarray:
    """A batched (leading-axis) operand lined up against results of `rank` trailing dims.

    NumPy aligns trailing axes, so a per-child scalar `[C]` next to a vector
    `[H]` must become `[C, 1]`; unbatched operands already line up.
    """
    if value.domain != Domain.CHILD or len(value.shape) >= rank:
        return x
    return x.reshape(x.shape[:1] + (1,) * (rank - len(value.shape)) + x.shape[1:])


def _lead(x: np.ndarray, value: Value, count: int) -> np.ndarray:
    """Give an unbatched operand the leading axis of `count` rows (for concat)."""
    if value.domain == Domain.CHILD:
        return x
    return np.broadcast_to(x, (count, *x.shape))


def eval_value(
    value: Value, args: list[np.ndarray], arg_values: list[Value], node: NodeView, batched: bool = False
) -> np.ndarray:
    """The rule of one op. ``batched`` marks leading-axis operands (children, or nodes in read-outs)."""
    op = value.op
    if op == Op.PARAM:
        return node.params[value.name]
    if op == Op.INPUT:
        return node.inputs[value.name][node.index]
    if op == Op.STATE:
        return node.states[value.name][node.index]
    if op == Op.CHILD_STATE:
        return node.states[value.name][node.children]
    if op == Op.CHILD_STATE_AT:
        k = value.attr("k")
        if k < len(node.children):
            return node.states[value.name][node.children[k]]
        return np.zeros(value.shape, node.dtype)
    if op == Op.HOISTED:
        return node.hoisted[value.name]
    if op == Op.ADJOINT:
        return node.adjoints[value.name]
    if op == Op.SAVED:
        column, size = value.attr("column"), int(np.prod(value.shape))
        return node.saved[value.name][column : column + size].reshape(value.shape)
    if op == Op.NUM_CHILDREN:
        return np.asarray(len(node.children), node.dtype)
    if op == Op.TRANSPOSE:
        return np.swapaxes(args[0], -1, -2)
    if op == Op.OUTER:
        a, b = args
        return a[..., :, None] * b[..., None, :]
    if op == Op.ROWSUM:
        rank = len(arg_values[0].shape)
        total = args[0].sum(axis=tuple(range(-rank, 0))) if rank else args[0]
        return total.reshape(total.shape + value.shape)  # a scalar, or [1] for a broadcast [1] operand
    if op == Op.PAD:
        lo, rank = value.attr("lo"), len(value.shape)
        shape = args[0].shape[: args[0].ndim - rank] + value.shape
        padded = np.zeros(shape, node.dtype)
        place: tuple[Any, ...] = (Ellipsis, slice(lo, lo + arg_values[0].shape[0])) + (slice(None),) * (rank - 1)
        padded[place] = args[0]
        return padded
    if op == Op.CONST:
        return np.full(value.shape, value.attr("value"), node.dtype)
    definition = OPS.get(op)
    if definition is not None:  # elementwise and vector ops: the registry's NumPy rule
        if definition.identity is not None:  # dropout: which element of which node (index = the node's id)
            children = len(node.children) if value.domain == Domain.CHILD else None
            where = Identity(node.dropout, node.index, children)
            with np.errstate(all="ignore"):
                return definition.identity(args[0], dict(value.attrs), where).astype(node.dtype, copy=False)
        if definition.kind == OpKind.BINARY:
            rank = len(value.shape)
            args = [_batched(x, v, rank) for x, v in zip(args, arg_values)]
        with np.errstate(all="ignore"):  # IEEE results (inf, nan) at saturated inputs are the meaning, not news
            return definition.numpy(*args).astype(node.dtype, copy=False)
    if op == Op.MATMUL:
        a, b = args
        with np.errstate(all="ignore"):  # inf * 0 inside a product is NaN, as in the kernels: not news
            if len(arg_values[1].shape) == 1:
                return np.matmul(a, b[..., None])[..., 0]
            return np.matmul(a, b)
    if op == Op.SLICE:
        rows = slice(value.attr("lo"), value.attr("hi"))
        if len(value.shape) == 2:  # rows of a matrix (made by autodiff for concat)
            return args[0][..., rows, :]
        return args[0][..., rows]
    if op == Op.CONCAT:
        axis = -1 if len(value.shape) == 1 else -2
        if value.domain == Domain.CHILD:
            count = next(x.shape[0] for x, v in zip(args, arg_values) if v.domain == Domain.CHILD)
            args = [_lead(x, v, count) for x, v in zip(args, arg_values)]
        return np.concatenate(args, axis=axis)
    if op == Op.EMBED:
        return args[0][args[1]]
    if op == Op.EXPAND:
        return np.broadcast_to(args[0], (len(node.children), *args[0].shape))
    if op == Op.SUM:
        return args[0].sum(axis=0)
    if op == Op.MEAN:
        return args[0].mean(axis=0) if len(args[0]) else np.zeros(value.shape, node.dtype)
    if op == Op.MAX:
        return args[0].max(axis=0) if len(args[0]) else np.zeros(value.shape, node.dtype)
    if op == Op.CHILD_SOFTMAX:  # across the children (axis 0), per component; no children: no rows
        if not len(args[0]):
            return args[0]
        with np.errstate(all="ignore"):  # saturated scores give IEEE results (inf - inf is NaN), quietly
            shifted = np.exp(args[0] - args[0].max(axis=0, keepdims=True))
            return (shifted / shifted.sum(axis=0, keepdims=True)).astype(node.dtype, copy=False)
    raise NotImplementedError(f"no interpreter rule for {op}")  # pragma: no cover


def eval_body(body: Body, node: NodeView) -> list[np.ndarray]:
    results: list[np.ndarray] = []
    for value in body.values:
        args = [results[a] for a in value.args]
        arg_values = [body.values[a] for a in value.args]
        results.append(eval_value(value, args, arg_values, node))
    return results
