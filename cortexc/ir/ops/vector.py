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
    Emitter,
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
    fmt_shape,
)

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


def _d_rowsum(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """Every element gets the total's gradient."""
    ones = d.op(Op.CONST, shape=d.value(args[0]).shape, domain=Domain.PARAM, attrs=(("value", 1.0),))
    yield d.op(Op.MUL, ones, g, shape=d.value(args[0]).shape)


def _not_in_c(e: Emitter, value: Value) -> str:  # pragma: no cover - a row op has a step of its own
    raise NotImplementedError(f"{value.op.value} is computed by a row step, not an expression")


def row_entry(
    op: Op,
    surface: str | None,
    shape: Callable[..., Shape],
    numpy: Callable[..., np.ndarray],
    derivative,
    row: RowOp,
    arity: int = 1,
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
        _not_in_c,
        step=StepKind.ROW,
        shape=shape,
        numpy=numpy,
        row=row,
    )


#: max, then exponentials and their sum, then the quotient; each x computed once and kept (recomputed,
#: fast-math may round it otherwise than for the max)
_SOFTMAX_PASSES = (
    RowPass("{0}", "top = fmaxf(top, out_row[j])"),
    RowPass("expf(out_row[j] - top)", "total += out_row[j]"),
)
_SOFTMAX_ACCUMULATORS = (("top", "-FLT_MAX"), ("total", "0.0f"))


def _rowsum_type(ctx, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
    """A scalar, or `[1]` (the gradient of a broadcast `[1]` operand): autodiff says which."""
    if value.shape not in ((), (1,)):
        raise ShapeError("a row sum is a scalar or [1]")
    return value.shape, args[0].domain


def _rowsum(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
    rank = len(arg_values[0].shape)
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
        _not_in_c,
        step=StepKind.ROW,
        row=RowOp((("total", "0.0f"),), (RowPass("", "total += {0}"),), scalar="total"),
    ),
)
