"""The ops that read or move data rather than compute numbers: the leaves of a body (params, inputs, states,
hoisted rows, constants, a gradient's seeds and saved values), products, slices, concatenations, look-ups,
transposes, outer products and padding, each an entry with all its rules, as JAX registers `concatenate`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cortexc.ir.ops.base import (
    Derivatives,
    Domain,
    DType,
    Emitter,
    NodeEnv,
    Op,
    OpDef,
    OpKind,
    Placement,
    Shape,
    ShapeError,
    StepKind,
    TypeContext,
    computed_by_a_step,
    expect,
    float_literal,
    fmt_shape,
    no_gradient,
    param_views,
    slice_offset,
    width,
)

if TYPE_CHECKING:
    from cortexc.ir.cell import Value


# ----------------------------------------------------------------------------- shape rules


def matmul_shape(a: Shape, b: Shape) -> Shape:
    if len(a) != 2:
        raise ShapeError(f"the left operand must be a matrix, not {fmt_shape(a)}")
    if len(b) not in (1, 2):
        raise ShapeError(f"the right operand must be a vector or a matrix, not {fmt_shape(b)}")
    if a[1] != b[0]:
        raise ShapeError(f"{fmt_shape(a)} by {fmt_shape(b)}: inner dimensions {a[1]} and {b[0]} differ")
    return (a[0],) if len(b) == 1 else (a[0], b[1])


def concat_shape(shapes: list[Shape]) -> Shape:
    if not shapes:
        raise ShapeError("concat needs at least one operand")
    ranks = {len(s) for s in shapes}
    if ranks == {1}:
        return (sum(s[0] for s in shapes),)
    if ranks == {2}:
        cols = {s[1] for s in shapes}
        if len(cols) != 1:
            raise ShapeError(
                "matrices stacked by rows need the same number of columns, got "
                + ", ".join(fmt_shape(s) for s in shapes)
            )
        return (sum(s[0] for s in shapes), shapes[0][1])
    raise ShapeError("concat takes all vectors or all matrices, got " + ", ".join(fmt_shape(s) for s in shapes))


def slice_shape(shape: Shape, lo: int, hi: int) -> Shape:
    """A vector's elements lo:hi, or a matrix's rows lo:hi (the latter only made by autodiff)."""
    if len(shape) not in (1, 2):
        raise ShapeError(f"only vectors can be sliced, not {fmt_shape(shape)}")
    if 0 <= hi <= lo <= shape[0]:
        raise ShapeError(f"slice [{lo}:{hi}] is empty (its end must come after its start)")
    if not 0 <= lo < hi <= shape[0]:
        raise ShapeError(f"slice [{lo}:{hi}] is out of range for a vector of {shape[0]}")
    return (hi - lo, *shape[1:])


def pad_shape(shape: Shape, lo: int, size: int) -> Shape:
    if len(shape) not in (1, 2) or not 0 <= lo <= size - shape[0]:
        raise ShapeError(f"cannot place {fmt_shape(shape)} at {lo} in {size}")
    return (size, *shape[1:])


def _widest(args: Sequence[Value]) -> Domain:
    return max((a.domain for a in args), default=Domain.PARAM)


# ----------------------------------------------------------------------------- leaves


def _gradient_of(kind: str):
    """The derivative of a leaf: the adjoint is a result of the gradient body, the gradient of `kind`."""

    def rule(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
        d.gradient(kind, g, value.name)
        yield from ()

    return rule


def _param_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    views = param_views(ctx.param_shape(value.name))
    expect(value.shape in views, f"param {value.name} is read as {fmt_shape(value.shape)}, not as its declared shape")
    return value.shape, Domain.PARAM


def _input_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    shape, dtype, on_edge = ctx.input_decl(value.name)
    expect(value.dtype == dtype, "input dtype differs from its decl")
    expect(not on_edge, "an edge input is read per child edge (edge_input)")
    return shape, Domain.NODE


def _state_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.output_body, "a node's own state is read only by outputs")
    return ctx.state_shape(value.name), Domain.NODE


def _hoisted_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.node_body, "hoisted values are read by node bodies")
    return ctx.hoisted_shape(value.name), Domain.NODE


def _const_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(isinstance(value.attr("value"), float), "a constant must be a float")
    return value.shape, Domain.PARAM  # a scalar, or a filled vector/matrix


def _adjoint_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.gradient, "adjoints are read only by gradient bodies")
    return value.shape, Domain.NODE


def _saved_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(ctx.gradient, "saved values are read only by gradient bodies")
    expect(value.attr("column") >= 0, "a saved value's column is negative")
    return value.shape, Domain.NODE


def _saved(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    column, size = value.attr("column"), int(np.prod(value.shape))
    return env.saved[value.name][column : column + size].reshape(value.shape)


def _leaf(op: Op, type_rule, interp, derivative, c_rule, **more: Any) -> OpDef:
    return OpDef(op, OpKind.LEAF, None, 0, type_rule, interp, derivative, Placement.SOURCE, c_rule, **more)


LEAVES: tuple[OpDef, ...] = (
    _leaf(
        Op.PARAM,
        _param_type,
        lambda env, value, xs, args: env.params[value.name].reshape(value.shape),  # a 3-D family: its view
        _gradient_of("d_param"),
        lambda e, value: e.param(value.name, e.col),
    ),
    _leaf(
        Op.INPUT,
        _input_type,
        lambda env, value, xs, args: env.inputs[value.name][env.input_row],
        _gradient_of("d_input"),
        lambda e, value: e.read("input", value.name, "node", width(value)),
    ),
    _leaf(
        Op.STATE,
        _state_type,
        lambda env, value, xs, args: env.states[value.name][env.index],
        _gradient_of("d_state"),
        lambda e, value: e.read("state", value.name, "node", width(value)),
    ),
    _leaf(
        Op.HOISTED,
        _hoisted_type,
        lambda env, value, xs, args: env.hoisted[value.name],
        _gradient_of("d_hoisted"),
        lambda e, value: e.read("pre", value.name, "pre", width(value)),
    ),
    _leaf(
        Op.CONST,
        _const_type,
        lambda env, value, xs, args: np.full(value.shape, value.attr("value"), env.dtype),
        no_gradient,
        lambda e, value: float_literal(value.attr("value")),
        addressable=False,
    ),
    _leaf(
        Op.ADJOINT,
        _adjoint_type,
        lambda env, value, xs, args: env.adjoints[value.name],
        no_gradient,
        lambda e, value: e.adjoint(value.name, width(value)),
    ),
    _leaf(
        Op.SAVED,
        _saved_type,
        _saved,
        no_gradient,
        lambda e, value: e.saved(value.name, value.attr("column")),
    ),
)


# ----------------------------------------------------------------------------- products and views


def _matmul_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    return matmul_shape(args[0].shape, args[1].shape), _widest(args)


def _matmul(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    a, b = xs
    with np.errstate(all="ignore"):  # inf * 0 inside a product is NaN, as in the kernels: not news
        if len(arg_values[1].shape) == 1:
            return np.matmul(a, b[..., None])[..., 0]
        return np.matmul(a, b)


def _d_matmul(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """``W @ x``: outer(g, x) to W, transpose(W) @ g to x; ``A @ B``: g @ transpose(B), transpose(A) @ g."""
    a, b = args
    left, right = d.value(a), d.value(b)
    left_t = d.op(Op.TRANSPOSE, a, shape=(left.shape[1], left.shape[0]))
    if len(right.shape) == 1:
        yield d.op(Op.OUTER, g, b, shape=(d.value(g).shape[0], right.shape[0]))
    else:
        right_t = d.op(Op.TRANSPOSE, b, shape=(right.shape[1], right.shape[0]))
        yield d.op(Op.MATMUL, g, right_t, shape=matmul_shape(d.value(g).shape, d.value(right_t).shape))
    yield d.op(Op.MATMUL, left_t, g, shape=matmul_shape(d.value(left_t).shape, d.value(g).shape))


def _slice_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    return slice_shape(args[0].shape, value.attr("lo"), value.attr("hi")), args[0].domain


def _slice(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    rows = slice(value.attr("lo"), value.attr("hi"))
    if len(value.shape) == 2:  # rows of a matrix (made by autodiff for concat)
        return xs[0][..., rows, :]
    return xs[0][..., rows]


def _d_slice(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """The gradient put back in place (`pad`)."""
    size, lo = d.value(args[0]).shape[0], value.attr("lo")
    shape = pad_shape(d.value(g).shape, lo, size)
    yield d.op(Op.PAD, g, shape=shape, attrs=(("lo", lo), ("size", size)))


def _c_slice(e: Emitter, value: Value) -> str:
    return e.arg(0, f"{e.col} + {slice_offset(e.arg_value(0), value.attr('lo'))}")


def _concat_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    return concat_shape([a.shape for a in args]), _widest(args)


def _concat(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    axis = -1 if len(value.shape) == 1 else -2
    if value.domain == Domain.CHILD:  # per-node parts get the leading axis of the children
        count = next(x.shape[0] for x, v in zip(xs, arg_values) if v.domain == Domain.CHILD)
        xs = [x if v.domain == Domain.CHILD else np.broadcast_to(x, (count, *x.shape)) for x, v in zip(xs, arg_values)]
    return np.concatenate(xs, axis=axis)


def _d_concat(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """The slices of the gradient."""
    start = 0
    for arg in args:
        stop = start + d.value(arg).shape[0]
        shape = slice_shape(d.value(g).shape, start, stop)
        yield d.op(Op.SLICE, g, shape=shape, attrs=(("lo", start), ("hi", stop)))
        start = stop


def _embed_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    """A row of a param matrix (of a 3-D family, read as ``R`` rows of ``M*K``: a matrix once reshaped)."""
    expect(args[0].op == Op.PARAM and len(args[0].shape) == 2, "a look-up reads a param matrix")
    expect(args[1].dtype == DType.I32, "a look-up needs an index")
    return (args[0].shape[1],), _widest(args)


def _d_embed(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """The gradient goes to the looked-up row of the table (a result of its own, by the index input)."""
    table, row = d.value(args[0]), d.value(args[1])
    d.gradient("d_embed", g, table.name, index=row.name)
    yield from ()


def _c_embed(e: Emitter, value: Value) -> str:
    table, index = e.arg_value(0), e.arg_value(1)
    row = e.edge_index(index.name) if index.op == Op.EDGE_INPUT else e.index(index.name)
    return e.param(table.name, f"{row} * {table.shape[1]} + {e.col}")


def _reshape_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(len(value.shape) in (1, 2) and width(value) == width(args[0]), "a reshape keeps the row's floats")
    return value.shape, args[0].domain


def _reshape(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    leading = xs[0].shape[: xs[0].ndim - len(arg_values[0].shape)]  # per child: the children's axis
    return xs[0].reshape(leading + value.shape)


def _d_reshape(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.RESHAPE, g, shape=d.value(args[0]).shape)


def _is_row_index(value: Value, index: Value) -> bool:
    """What chooses a row of a family's products: an index value, or (``by=position``) a child's place among
    its siblings, a `[1]` float (`edge.position`, or in a down cell the runtime's edge input of it)."""
    by_position = dict(value.attrs).get("by") == "position"
    return index.dtype == DType.I32 if not by_position else index.dtype == DType.F32 and index.shape == (1,)


def _rows_chosen(env: NodeEnv, index: np.ndarray, index_value: Value) -> np.ndarray:
    """The interpreter's row numbers (int64): one per child (or one) from an index value or positions."""
    leading = index.shape[: index.ndim - len(index_value.shape)]
    return np.asarray(index).reshape(leading).astype(np.int64)


def _select_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(len(args[0].shape) == 2, "a selection takes a row of a matrix")
    expect(_is_row_index(value, args[1]), "a row is chosen by an index value or edge.position")
    return (args[0].shape[1],), _widest(args)


def _select(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    rows = _rows_chosen(env, xs[1], arg_values[1])
    matrices = np.broadcast_to(xs[0], rows.shape + arg_values[0].shape)
    return np.take_along_axis(matrices, rows[..., None, None], axis=-2)[..., 0, :]


def _d_select(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """The gradient goes to the chosen row alone (`unselect`)."""
    rows = d.value(args[0]).shape[0]
    attrs = (("rows", rows), *value.attrs)
    yield d.op(Op.UNSELECT, g, args[1], shape=(rows, d.value(g).shape[0]), attrs=attrs)
    yield None


def _c_select(e: Emitter, value: Value) -> str:
    m = value.shape[0]
    return e.arg(0, f"(int64_t)({e.arg(1, '0')}) * {m} + ({e.col})")


def _unselect_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(len(args[0].shape) == 1 and _is_row_index(value, args[1]), "unselect puts a row back by its index")
    return (value.attr("rows"), args[0].shape[0]), _widest(args)


def _unselect(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    rows = _rows_chosen(env, xs[1], arg_values[1])
    chosen = np.arange(value.attr("rows")) == rows[..., None]  # [..., R]
    return np.where(chosen[..., None], xs[0][..., None, :], np.zeros((), env.dtype)).astype(env.dtype, copy=False)


def _d_unselect(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    attrs = tuple((k, v) for k, v in value.attrs if k != "rows")
    yield d.op(Op.SELECT, g, args[1], shape=d.value(args[0]).shape, attrs=attrs)
    yield None


def _c_unselect(e: Emitter, value: Value) -> str:
    m = value.shape[1]
    row = f"(int64_t)({e.arg(1, '0')})"
    return f"({row} == ({e.col}) / {m} ? {e.arg(0, f'({e.col}) % {m}')} : 0.0f)"


def _transpose_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(len(args[0].shape) == 2, "transpose needs a matrix")
    return (args[0].shape[1], args[0].shape[0]), args[0].domain


def _d_transpose(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    shape = d.value(g).shape
    yield d.op(Op.TRANSPOSE, g, shape=(shape[1], shape[0]))


def _c_transpose(e: Emitter, value: Value) -> str:
    """Element (i, j) of the [K, M] transpose is (j, i) of the [M, K] matrix."""
    m, k = e.arg_value(0).shape
    row, column = e.col_split(m)
    return e.arg(0, f"{column} * {k} + {row}")


def _outer_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    expect(len(args[0].shape) == 1 and len(args[1].shape) == 1, "outer needs two vectors")
    return (args[0].shape[0], args[1].shape[0]), _widest(args)


def _d_outer(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """g @ b to a, transpose(g) @ a to b."""
    a, b = args
    m, k = d.value(g).shape
    yield d.op(Op.MATMUL, g, b, shape=(m,))
    yield d.op(Op.MATMUL, d.op(Op.TRANSPOSE, g, shape=(k, m)), a, shape=(k,))


def _c_outer(e: Emitter, value: Value) -> str:
    p, q = e.col_split(value.shape[1])
    return f"({e.arg(0, p)} * {e.arg(1, q)})"


def _pad_type(ctx: TypeContext, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    return pad_shape(args[0].shape, value.attr("lo"), value.attr("size")), args[0].domain


def _pad(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    lo, rank = value.attr("lo"), len(value.shape)
    shape = xs[0].shape[: xs[0].ndim - rank] + value.shape
    padded = np.zeros(shape, env.dtype)
    place: tuple[Any, ...] = (Ellipsis, slice(lo, lo + arg_values[0].shape[0])) + (slice(None),) * (rank - 1)
    padded[place] = xs[0]
    return padded


def _d_pad(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    lo = value.attr("lo")
    stop = lo + d.value(args[0]).shape[0]
    yield d.op(Op.SLICE, g, shape=slice_shape(d.value(g).shape, lo, stop), attrs=(("lo", lo), ("hi", stop)))


def _c_pad(e: Emitter, value: Value) -> str:
    arg = e.arg_value(0)
    lo, size = slice_offset(arg, value.attr("lo")), width(arg)
    inner = e.arg(0, f"({e.col}) - {lo}")
    return f"(({e.col}) >= {lo} && ({e.col}) < {lo + size} ? {inner} : 0.0f)"


_S = OpKind.STRUCTURAL

STRUCTURAL: tuple[OpDef, ...] = (
    *LEAVES,
    OpDef(
        Op.MATMUL,
        _S,
        "@",
        2,
        _matmul_type,
        _matmul,
        _d_matmul,
        Placement.STEP,
        computed_by_a_step,
        step=StepKind.SMALL_MATMUL,
        at_zero=0.0,
        zero_absorbs=(0, 1),
    ),
    OpDef(
        Op.SLICE,
        _S,
        None,
        1,
        _slice_type,
        _slice,
        _d_slice,
        Placement.VIEW,
        _c_slice,
        at_zero=0.0,
        zero_absorbs=(0,),
        view_column=lambda base, value: slice_offset(base, value.attr("lo")),
    ),
    OpDef(
        Op.RESHAPE,
        _S,
        None,
        1,
        _reshape_type,
        _reshape,
        _d_reshape,
        Placement.VIEW,
        lambda e, value: e.arg(0),
        at_zero=0.0,
        zero_absorbs=(0,),
        view_column=lambda base, value: 0,
    ),
    OpDef(
        Op.CONCAT,
        _S,
        "concat",
        None,
        _concat_type,
        _concat,
        _d_concat,
        Placement.STEP,
        computed_by_a_step,
        step=StepKind.CONCAT,
        at_zero=0.0,
    ),
    OpDef(
        Op.EMBED,
        _S,
        None,
        2,
        _embed_type,
        lambda env, value, xs, args: xs[0][xs[1]],
        _d_embed,
        Placement.SOURCE,
        _c_embed,
        index_args=(1,),
    ),
    OpDef(
        Op.SELECT,
        _S,
        None,
        2,
        _select_type,
        _select,
        _d_select,
        Placement.ELEMENTWISE,
        _c_select,
        at_zero=0.0,
        zero_absorbs=(0,),
        index_args=(1,),
    ),
    OpDef(
        Op.UNSELECT,
        _S,
        None,
        2,
        _unselect_type,
        _unselect,
        _d_unselect,
        Placement.ELEMENTWISE,
        _c_unselect,
        at_zero=0.0,
        zero_absorbs=(0,),
        index_args=(1,),
    ),
    OpDef(
        Op.TRANSPOSE,
        _S,
        None,
        1,
        _transpose_type,
        lambda env, value, xs, args: np.swapaxes(xs[0], -1, -2),
        _d_transpose,
        Placement.EXPRESSION,
        _c_transpose,
    ),
    OpDef(
        Op.OUTER,
        _S,
        None,
        2,
        _outer_type,
        lambda env, value, xs, args: xs[0][..., :, None] * xs[1][..., None, :],
        _d_outer,
        Placement.EXPRESSION,
        _c_outer,
    ),
    OpDef(Op.PAD, _S, None, 1, _pad_type, _pad, _d_pad, Placement.ELEMENTWISE, _c_pad),
)
