"""The ops across a node's children: reads of the children's states, the count, `expand` (a per-node value
once per child), the reductions over the children and `child_softmax`. A node without children has zero-row
per-child values; `sum` of them is 0, and `mean` and `max` are defined as 0."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from cortexc.ir.ops.base import (
    ChildReduce,
    Derivatives,
    Domain,
    Emitter,
    NodeEnv,
    Op,
    OpDef,
    OpKind,
    Placement,
    Shape,
    StepKind,
    TypeContext,
    computed_by_a_step,
    expect,
    no_gradient,
    width,
)
from cortexc.runtime.signature import GIVEN_INPUTS

if TYPE_CHECKING:
    from cortexc.ir.cell import Value


def _child_state_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.node_body, "children are read only in node bodies")
    if value.op == Op.CHILD_STATE_AT:
        k = value.attr("k")
        expect(ctx.arity is not None and 0 <= k < ctx.arity, "child index out of arity")
        return ctx.state_shape(value.name), Domain.NODE
    return ctx.state_shape(value.name), Domain.CHILD


def _child_state_at(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    k = value.attr("k")
    if k < len(env.children):
        return env.states[value.name][env.children[k]]
    return np.zeros(value.shape, env.dtype)


def _d_child_state(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    d.gradient("d_child", g, value.name)
    yield from ()


def _d_child_state_at(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    d.gradient("d_child_at", g, value.name, k=value.attr("k"))
    yield from ()


def _prev_state_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.node_body and ctx.steps, "prev is read only in a graph cell's node bodies")
    return ctx.state_shape(value.name), Domain.NODE


def _d_prev_state(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    d.gradient("d_prev", g, value.name)
    yield from ()


def _num_children_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.node_body, "the number of children is read only in node bodies")
    return (), Domain.NODE


def _expand_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(args[0].domain != Domain.CHILD, "expand of a per-child value")
    return args[0].shape, Domain.CHILD


def _d_expand(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """The sum over the children."""
    yield d.op(Op.SUM, g, domain=Domain.NODE)


def _reduce_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(args[0].domain == Domain.CHILD, "a reduction needs a per-child argument")
    expect(ctx.node_body, "reductions over children happen only in node bodies")
    return args[0].shape, Domain.NODE


def _sum(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    return xs[0].sum(axis=0)


def _mean(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    return xs[0].mean(axis=0) if len(xs[0]) else np.zeros(value.shape, env.dtype)


def _max(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    return xs[0].max(axis=0) if len(xs[0]) else np.zeros(value.shape, env.dtype)


def _d_sum(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.EXPAND, g, domain=Domain.CHILD)


def _d_mean(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    count = d.op(Op.NUM_CHILDREN, shape=(), domain=Domain.NODE)
    yield d.op(Op.EXPAND, d.op(Op.DIV, g, count), domain=Domain.CHILD)


def _d_max(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """Tied children share the gradient (as torch.amax does)."""
    holds_max = d.op(Op.EQ, args[0], d.op(Op.EXPAND, y, domain=Domain.CHILD))
    ties = d.op(Op.SUM, holds_max, domain=Domain.NODE)
    share = d.op(Op.EXPAND, d.op(Op.DIV, g, ties), domain=Domain.CHILD)
    yield d.op(Op.MUL, holds_max, share)


def _child_softmax_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(args[0].domain == Domain.CHILD, "child_softmax needs a per-child argument")
    expect(ctx.node_body, "child_softmax happens only in node bodies")
    return args[0].shape, Domain.CHILD


def _child_softmax(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    """Across the children (axis 0), per component; no children: no rows."""
    if not len(xs[0]):
        return xs[0]
    with np.errstate(all="ignore"):  # saturated scores give IEEE results (inf - inf is NaN), quietly
        shifted = np.exp(xs[0] - xs[0].max(axis=0, keepdims=True))
        return (shifted / shifted.sum(axis=0, keepdims=True)).astype(env.dtype, copy=False)


def _d_child_softmax(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """d e_j = y_j * (g_j - sum_k y_k g_k), over the node's children (the softmax Jacobian across them, of
    `sum`, `expand`, `sub` and `mul`, so the gradient kernels need no step of their own)."""
    dot = d.op(Op.SUM, d.op(Op.MUL, y, g), domain=Domain.NODE)
    centred = d.op(Op.SUB, g, d.op(Op.EXPAND, dot, domain=Domain.CHILD))
    yield d.op(Op.MUL, y, centred)


#: the values every edge has (Version 3: `edge.position`, `edge.siblings`), by name
EDGE_VALUES = ("position", "siblings")


def _edge_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.node_body, "edges are read only in node bodies")
    expect(value.name in EDGE_VALUES, f"an edge has no value {value.name!r}")
    if value.op == Op.EDGE_AT:
        k = value.attr("k")
        expect(ctx.arity is not None and 0 <= k < ctx.arity, "edge index out of arity")
        return (1,), Domain.NODE
    return (1,), Domain.CHILD


def _edge(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    count = len(env.children)
    if value.name == "position":
        return np.arange(count, dtype=env.dtype).reshape(count, 1)
    return np.full((count, 1), count, env.dtype)


def _edge_at(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    count, k = len(env.children), value.attr("k")
    if k >= count:
        return np.zeros((1,), env.dtype)
    return np.full((1,), k if value.name == "position" else count, env.dtype)


def _edge_input_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.node_body, "edges are read only in node bodies")
    shape, dtype, on_edge = ctx.input_decl(value.name)
    expect(on_edge, "a node input is read per node (input)")
    expect(value.dtype == dtype, "input dtype differs from its decl")
    return shape, Domain.CHILD


def _d_edge_input(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """The gradient of a float edge input is a result per child edge (an index one is never differentiated, nor
    the positions and sibling counts the runtime gives a down cell)."""
    if value.name not in GIVEN_INPUTS.values():
        d.gradient("d_edge_input", g, value.name)
    yield from ()


def _c_edge(e: Emitter, value: Value) -> str:
    return e.edge_position() if value.name == "position" else e.edge_siblings()


def _c_edge_at(e: Emitter, value: Value) -> str:
    k = value.attr("k")
    present = f"{k}.0f" if value.name == "position" else e.num_children()
    return f"({e.has_child(k)} ? {present} : 0.0f)"


_C = OpKind.CHILDREN


def _reduction(op: Op, interp, derivative, reduce: ChildReduce) -> OpDef:
    return OpDef(
        op,
        _C,
        op.value,
        1,
        _reduce_type,
        interp,
        derivative,
        Placement.STEP,
        computed_by_a_step,
        step=StepKind.REDUCE,
        reduce=reduce,
        childless_zero=True,
    )


CHILDREN: tuple[OpDef, ...] = (
    OpDef(
        Op.CHILD_STATE,
        OpKind.LEAF,
        None,
        0,
        _child_state_type,
        lambda env, value, xs, args: env.states[value.name][env.children],
        _d_child_state,
        Placement.SOURCE,
        lambda e, value: e.read("state", value.name, "child", width(value)),
        reads_children=True,
    ),
    OpDef(
        Op.CHILD_STATE_AT,
        OpKind.LEAF,
        None,
        0,
        _child_state_type,
        _child_state_at,
        _d_child_state_at,
        Placement.SOURCE,
        lambda e, value: e.read("state", value.name, f"kid{value.attr('k')}", width(value)),
        reads_children=True,
        childless_zero=True,
    ),
    OpDef(
        Op.PREV_STATE,
        OpKind.LEAF,
        None,
        0,
        _prev_state_type,
        lambda env, value, xs, args: env.states[value.name][env.prev],
        _d_prev_state,
        Placement.SOURCE,
        lambda e, value: e.read("state", value.name, "prev", width(value)),
        reads_children=True,  # another node's state, of the level below: never hoisted above the levels
    ),
    OpDef(
        Op.NUM_CHILDREN,
        OpKind.LEAF,
        None,
        0,
        _num_children_type,
        lambda env, value, xs, args: np.asarray(len(env.children), env.dtype),
        no_gradient,
        Placement.SOURCE,
        lambda e, value: e.num_children(),
        reads_children=True,
    ),
    OpDef(
        Op.EXPAND,
        _C,
        None,
        1,
        _expand_type,
        lambda env, value, xs, args: np.broadcast_to(xs[0], (len(env.children), *xs[0].shape)),
        _d_expand,
        Placement.EXPRESSION,
        lambda e, value: e.arg(0),
    ),
    _reduction(Op.SUM, _sum, _d_sum, ChildReduce("0.0f", "add", mean=False)),
    _reduction(Op.MEAN, _mean, _d_mean, ChildReduce("0.0f", "add", mean=True)),
    _reduction(Op.MAX, _max, _d_max, ChildReduce("-FLT_MAX", "max", mean=False)),
    OpDef(
        Op.EDGE,
        OpKind.LEAF,
        None,
        0,
        _edge_type,
        _edge,
        no_gradient,
        Placement.SOURCE,
        _c_edge,
        reads_children=True,
        addressable=False,
    ),
    OpDef(
        Op.EDGE_AT,
        OpKind.LEAF,
        None,
        0,
        _edge_type,
        _edge_at,
        no_gradient,
        Placement.SOURCE,
        _c_edge_at,
        reads_children=True,
        childless_zero=True,
        addressable=False,
    ),
    OpDef(
        Op.EDGE_INPUT,
        OpKind.LEAF,
        None,
        0,
        _edge_input_type,
        lambda env, value, xs, args: env.inputs[value.name][env.edges],
        _d_edge_input,
        Placement.SOURCE,
        lambda e, value: e.read("input", value.name, "edge", width(value)),
        reads_children=True,
    ),
    OpDef(
        Op.CHILD_SOFTMAX,
        _C,
        "child_softmax",
        1,
        _child_softmax_type,
        _child_softmax,
        _d_child_softmax,
        Placement.STEP,
        computed_by_a_step,
        step=StepKind.CHILD_SOFTMAX,
    ),
)
