"""The reference interpreter: the executable meaning of every IR op.

It runs a cell one node at a time, children before parents, with NumPy. It
is the oracle every compiled path is compared with and the "eager" baseline
of the benchmarks, so it favours being obviously right over being fast.

Array layout: a per-node value has its own shape (`[H]`, `[H, H]`); a
per-child value has one more leading axis, the children (`[num_children, H]`).
A node without children has zero-row per-child values, so `sum` gives 0
with no special case; `mean` and `max` of no children are defined as 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cortexc.ir.cell import Body, Cell, GradKind, Value
from cortexc.ir.ops import OPS, Domain, Op, OpKind
from cortexc.runtime.forest import Forest
from cortexc.runtime.params import check_params
from cortexc.runtime.validate import check_forest, check_inputs


class _Node:
    """What the rules of one node can see."""

    __slots__ = ("index", "children", "states", "inputs", "params", "dtype", "hoisted", "adjoints")

    def __init__(self, index, children, states, inputs, params, dtype):
        self.index = index
        self.children = children
        self.states = states
        self.inputs = inputs
        self.params = params
        self.dtype = dtype
        self.hoisted: dict[str, np.ndarray] = {}  # this node's results of the cell's `pre` body
        self.adjoints: dict[str, np.ndarray] = {}  # incoming gradients, for gradient bodies


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
    value: Value, args: list[np.ndarray], arg_values: list[Value], node: _Node, batched: bool = False
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
    if op == Op.NUM_CHILDREN:
        return np.asarray(len(node.children), node.dtype)
    if op == Op.TRANSPOSE:
        return np.swapaxes(args[0], -1, -2)
    if op == Op.OUTER:
        a, b = args
        return a[..., :, None] * b[..., None, :]
    if op == Op.ROWSUM:
        rank = len(arg_values[0].shape)
        return args[0].sum(axis=tuple(range(-rank, 0))) if rank else args[0]
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
        if definition.kind == OpKind.BINARY:
            rank = len(value.shape)
            args = [_batched(x, v, rank) for x, v in zip(args, arg_values)]
        return definition.numpy(*args).astype(node.dtype, copy=False)
    if op == Op.MATMUL:
        a, b = args
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
    raise NotImplementedError(f"no interpreter rule for {op}")  # pragma: no cover


def eval_body(body: Body, node: _Node) -> list[np.ndarray]:
    results: list[np.ndarray] = []
    for value in body.values:
        args = [results[a] for a in value.args]
        arg_values = [body.values[a] for a in value.args]
        results.append(eval_value(value, args, arg_values, node))
    return results


def run(
    cell: Cell, forest: Forest, params: Mapping[str, np.ndarray], inputs: Mapping[str, object], dtype=np.float32
) -> dict[str, np.ndarray]:
    """Every state (`[N, ...]` in the forest's node order) and every output of the cell.

    ``dtype`` is float32 like the compiled code, or float64 for gradient checks.
    Raises `ForestError`/`InputError` before computing anything if the forest or
    the inputs do not fit the cell.
    """
    check_forest(cell, forest)
    inputs = check_inputs(cell, forest, inputs, dtype)
    params = check_params(cell, params, dtype=dtype)
    n = forest.num_nodes
    states = {s.name: np.zeros((n, *s.shape), dtype) for s in cell.states}
    for index in forest.level_order:
        children = forest.children(int(index))
        body = cell.leaf if cell.leaf is not None and len(children) == 0 else cell.node
        node = _Node(int(index), children, states, inputs, params, dtype)
        if body is cell.node and cell.pre is not None:
            pre_values = eval_body(cell.pre, node)
            node.hoisted = {name: pre_values[result] for name, result in cell.pre.named_results}
        values = eval_body(body, node)
        for name, result in body.named_results:
            states[name][index] = values[result]
    out: dict[str, np.ndarray] = dict(states)
    for output in cell.outputs:
        rows = np.asarray(forest.roots if output.at_root else np.arange(n), dtype=np.int64)
        out[output.name] = _readout(output.body, rows, states, inputs, params, dtype)
    return out


def _readout(body: Body, rows: np.ndarray, states, inputs, params, dtype) -> np.ndarray:
    """A read-out for the given nodes, one node at a time like the recursion."""
    shape = body.values[body.results[0][1]].shape
    result = np.zeros((len(rows), *shape), dtype)
    for i, index in enumerate(rows):
        node = _Node(int(index), np.zeros(0, np.int64), states, inputs, params, dtype)
        result[i] = eval_body(body, node)[body.results[0][1]]
    return result


def backward(
    cell: Cell,
    forest: Forest,
    params: Mapping[str, np.ndarray],
    inputs: Mapping[str, object],
    states: Mapping[str, np.ndarray],
    upstream: Mapping[str, np.ndarray],
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Gradients of every param and float input, one node at a time, parents before children.

    `cell` must carry `grads` (the `autodiff` pass); `states` are the forward's
    states (what the forward with ``grad=True`` keeps); `upstream` maps states
    and outputs to their incoming gradients (`[N, ...]`, or `[num_roots, ...]`
    for outputs at the roots). Index inputs get none; an embedding table gets
    the sum of the gradients of the rows that were looked up.
    """
    grad_bodies, leaf_body = cell.grads, cell.leaf
    if grad_bodies is None or leaf_body is None:
        raise ValueError("backward needs a cell with gradient bodies (the specialize and autodiff passes)")
    check_forest(cell, forest)
    inputs = check_inputs(cell, forest, inputs, dtype)
    params = check_params(cell, params, dtype=dtype)
    n = forest.num_nodes
    d_states = {s.name: np.zeros((n, *s.shape), dtype) for s in cell.states}
    for name, grad in upstream.items():
        if name in d_states:
            d_states[name] += grad
    grads: dict[str, np.ndarray] = {p.name: np.zeros(p.shape, dtype) for p in cell.params}
    grads.update({i.name: np.zeros((n, *i.shape), dtype) for i in cell.inputs if not i.is_index})

    def accumulate(node: _Node, values: list[np.ndarray], body: Body) -> dict[str, np.ndarray]:
        """Send a gradient body's per-node results where they belong; returns the hoisted ones."""
        hoisted = {}
        for target, index in body.grad_results:
            value = values[index]
            if target.kind == GradKind.PARAM:
                grads[target.name] += value
            elif target.kind == GradKind.INPUT:
                grads[target.name][node.index] += value
            elif target.kind == GradKind.EMBED:
                assert target.index is not None  # GradTarget checks it is set for EMBED
                grads[target.name][node.inputs[target.index][node.index]] += value
            elif target.kind == GradKind.STATE:
                d_states[target.name][node.index] += value
            elif target.kind == GradKind.CHILD:
                np.add.at(d_states[target.name], node.children, value)
            elif target.kind == GradKind.CHILD_AT:
                assert target.k is not None  # GradTarget checks it is set for CHILD_AT
                if target.k < len(node.children):
                    d_states[target.name][node.children[target.k]] += value
            elif target.kind == GradKind.HOISTED:
                hoisted[target.name] = value
        return hoisted

    for output, grad_body in zip(cell.outputs, grad_bodies.outputs):
        if output.name not in upstream:
            continue
        rows = np.asarray(forest.roots if output.at_root else np.arange(n), dtype=np.int64)
        for position, index in enumerate(rows):
            node = _Node(int(index), np.zeros(0, np.int64), states, inputs, params, dtype)
            node.adjoints = {output.name: np.asarray(upstream[output.name][position], dtype)}
            accumulate(node, eval_body(grad_body, node), grad_body)

    for index in forest.level_order[::-1]:
        children = forest.children(int(index))
        leaf = len(children) == 0
        body, grad_body = (leaf_body, grad_bodies.leaf) if leaf else (cell.node, grad_bodies.node)
        node = _Node(int(index), children, states, inputs, params, dtype)
        if not leaf and cell.pre is not None:
            pre_values = eval_body(cell.pre, node)
            node.hoisted = {name: pre_values[result] for name, result in cell.pre.named_results}
        node.adjoints = {name: d_states[name][index] for name, _ in body.named_results}
        hoisted = accumulate(node, eval_body(grad_body, node), grad_body)
        if hoisted and grad_bodies.pre is not None:
            node.adjoints = hoisted
            accumulate(node, eval_body(grad_bodies.pre, node), grad_bodies.pre)
    return grads
