"""Row ops: functions of a whole vector, each a `RowOp` (accumulators, passes over the row's elements, a
result per element or one scalar) that one generic kernel step renders. Softmax, log-softmax and the row sum
that autodiff makes are entries here like any other."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from cortexc.ir.ops.base import (
    Derivatives,
    Domain,
    NodeEnv,
    Op,
    OpDef,
    OpKind,
    Placement,
    RowOp,
    RowPass,
    Shape,
    ShapeError,
    StepKind,
    computed_by_a_step,
    fmt_shape,
)
from cortexc.ir.ops.elementwise import LAYERNORM_EPS, RSTD_HELPER

if TYPE_CHECKING:
    from cortexc.ir.cell import Value


def vector_shape(a: Shape) -> Shape:
    """A vector op (softmax) takes a vector and keeps its shape."""
    if len(a) != 1:
        raise ShapeError(f"takes a vector, not {fmt_shape(a)}")
    return a


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _d_softmax(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    dot = d.rowsum(d.op(Op.MUL, g, y))
    yield d.op(Op.MUL, y, d.op(Op.SUB, g, dot))


def _d_log_softmax(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    total = d.rowsum(g)
    yield d.op(Op.SUB, g, d.op(Op.MUL, d.op(Op.EXP, y), total))


def dot_shape(a: Shape, b: Shape) -> Shape:
    """Two vectors of one length -> their inner product, a `[1]` value."""
    if len(a) != 1 or len(b) != 1:
        raise ShapeError(f"dot takes two vectors, not {fmt_shape(a)} and {fmt_shape(b)}")
    if a != b:
        raise ShapeError(f"dot of vectors of different lengths, {fmt_shape(a)} and {fmt_shape(b)}")
    return (1,)


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=-1, keepdims=True)


def _d_dot(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    a, b = args
    yield d.op(Op.MUL, g, b)
    yield d.op(Op.MUL, g, a)


def layernorm_shape(a: Shape) -> Shape:
    """A vector of at least two components (of one, it is always 0)."""
    return vector_shape(a)


def _layernorm(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf and NaN rows give IEEE results, quietly
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + LAYERNORM_EPS)


def _d_layernorm(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """r (g - mean(g) - y mean(g y)), r = 1 / sqrt(var(x) + eps) recomputed from x."""
    (x,) = args
    n = d.const(float(d.value(x).shape[0]))
    centred = d.op(Op.SUB, x, d.op(Op.DIV, d.rowsum(x), n))
    variance = d.op(Op.DIV, d.rowsum(d.op(Op.MUL, centred, centred)), n)
    r = d.op(Op.RSTD, variance)
    g_mean = d.op(Op.DIV, d.rowsum(g), n)
    gy_mean = d.op(Op.DIV, d.rowsum(d.op(Op.MUL, g, y)), n)
    yield d.op(Op.MUL, r, d.op(Op.SUB, d.op(Op.SUB, g, g_mean), d.op(Op.MUL, y, gy_mean)))


def _d_rowsum(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """Every element gets the total's gradient."""
    ones = d.op(Op.CONST, shape=d.value(args[0]).shape, domain=Domain.PARAM, attrs=(("value", 1.0),))
    yield d.op(Op.MUL, ones, g, shape=d.value(args[0]).shape)


def row_entry(
    op: Op,
    surface: str | None,
    shape: Callable[..., Shape],
    numpy: Callable[..., np.ndarray],
    derivative,
    row: RowOp,
    arity: int = 1,
    hint_on_one: str = "",
    c_helper: str = "",
) -> OpDef:
    """A row op's entry: its shape rule, NumPy rule over the last axis, derivative and `RowOp`."""

    def type_rule(ctx, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
        return shape(*(a.shape for a in args)), max(a.domain for a in args)

    def interp(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
        with np.errstate(all="ignore"):
            return numpy(*xs).astype(env.dtype, copy=False)

    return OpDef(
        op,
        OpKind.VECTOR,
        surface,
        arity,
        type_rule,
        interp,
        derivative,
        Placement.STEP,
        computed_by_a_step,
        step=StepKind.ROW,
        shape=shape,
        numpy=numpy,
        row=row,
        hint_on_one=hint_on_one,
        c_helper=c_helper,
    )


#: max, then exponentials and their sum, then the quotient; each x computed once and kept (recomputed,
#: fast-math may round it otherwise than for the max)
_SOFTMAX_PASSES = (
    RowPass("{0}", "top = fmaxf(top, out_row[j])"),
    RowPass("expf(out_row[j] - top)", "total += out_row[j]"),
)
_SOFTMAX_ACCUMULATORS = (("top", "-FLT_MAX"), ("total", "0.0f"))
_PER_CHILD_SCORES = "; to normalise per-child scores{across}, use child_softmax({arg})"


def _rowsum_type(ctx, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    """A scalar, or `[1]` (the gradient of a broadcast `[1]` operand): autodiff says which."""
    if value.shape not in ((), (1,)):
        raise ShapeError("a row sum is a scalar or [1]")
    return value.shape, args[0].domain


def _rowsum(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    rank = len(arg_values[0].shape)
    with np.errstate(all="ignore"):  # inf - inf in a row of saturated values is NaN, quietly
        total = xs[0].sum(axis=tuple(range(-rank, 0))) if rank else xs[0]
    return total.reshape(total.shape + value.shape)


VECTOR: tuple[OpDef, ...] = (
    row_entry(
        Op.SOFTMAX,
        "softmax",
        vector_shape,
        _softmax,
        _d_softmax,
        RowOp(_SOFTMAX_ACCUMULATORS, _SOFTMAX_PASSES, element="out_row[j] / total"),
        hint_on_one=_PER_CHILD_SCORES,
    ),
    row_entry(
        Op.LOG_SOFTMAX,
        "log_softmax",
        vector_shape,
        _log_softmax,
        _d_log_softmax,
        RowOp(
            _SOFTMAX_ACCUMULATORS,
            _SOFTMAX_PASSES,
            element="{0} - top - log_total",
            setup="const float log_total = logf(total);",
        ),
        hint_on_one=_PER_CHILD_SCORES,
    ),
    row_entry(
        Op.DOT,
        "dot",
        dot_shape,
        _dot,
        _d_dot,
        RowOp((("total", "0.0f"),), (RowPass("", "total += {0} * {1}"),), scalar="total"),
        arity=2,
    ),
    row_entry(
        Op.LAYERNORM,
        "layernorm",
        layernorm_shape,
        _layernorm,
        _d_layernorm,
        # the mean, then the biased variance of the centred row (kept in out_row), then the scaled row
        RowOp(
            (("mean", "0.0f"), ("var", "0.0f")),
            (
                RowPass("{0}", "mean += out_row[j]"),
                RowPass("out_row[j] - mean", "var += out_row[j] * out_row[j]", before="mean /= {n};"),
            ),
            element="out_row[j] * rstd",
            setup="const float rstd = cx_rstd(var / {n});",
        ),
        c_helper=RSTD_HELPER,
    ),
    OpDef(
        Op.ROWSUM,
        OpKind.VECTOR,
        None,
        1,
        _rowsum_type,
        _rowsum,
        _d_rowsum,
        Placement.STEP,
        computed_by_a_step,
        step=StepKind.ROW,
        row=RowOp((("total", "0.0f"),), (RowPass("", "total += {0}"),), scalar="total"),
    ),
)
