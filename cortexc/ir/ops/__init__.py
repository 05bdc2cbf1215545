"""The operations of the cortexc IR: one registry, `OPS`, with an entry (`OpDef`) for every op.

The entries are grouped by family: `elementwise` (unary and binary), `vector` (row ops: softmax, row sums),
`structural` (leaves, products, slices, concatenations, look-ups) and `children` (reads of children,
`expand`, reductions, `child_softmax`). Every stage reads an op's rules from its entry: the front end its
surface name, the verifier its type rule, the interpreter its NumPy rule, autodiff its derivative, the
scheduler its placement, codegen its C text. A new op is one `Op` member and one entry (`docs/architecture.md`,
"Add an op").
"""

from __future__ import annotations

from cortexc.ir.ops.base import (
    ChildReduce,
    Derivatives,
    Domain,
    DType,
    Emitter,
    Identity,
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
    TypeContext,
    expect,
    float_literal,
    fmt_shape,
    param_matrix,
    param_views,
    slice_offset,
    width,
)
from cortexc.ir.ops.children import CHILDREN
from cortexc.ir.ops.elementwise import ELEMENTWISE, broadcast_shape, same_shape
from cortexc.ir.ops.structural import STRUCTURAL, concat_shape, matmul_shape, pad_shape, slice_shape
from cortexc.ir.ops.vector import VECTOR, vector_shape

#: every op's entry; C helpers are emitted in this order
OPS: dict[Op, OpDef] = {d.op: d for d in (*ELEMENTWISE, *VECTOR, *STRUCTURAL, *CHILDREN)}

_missing = set(Op) - set(OPS)
if _missing:  # pragma: no cover - a new Op member without its entry
    raise ImportError(f"ops without a registry entry: {sorted(op.value for op in _missing)}")

#: the ops with no operands: values read from parameters, inputs, states, constants and the gradient's seeds
LEAF_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.LEAF)
BINARY_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.BINARY)
UNARY_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.UNARY)
ELEMENTWISE_OPS = BINARY_OPS | UNARY_OPS
VECTOR_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.VECTOR)
REDUCE_OPS = frozenset(op for op, d in OPS.items() if d.reduce is not None)
CHILD_READ_OPS = frozenset(op for op, d in OPS.items() if d.reads_children)

#: surface names of the built-in functions and operators, as written in a `.cell` file
UNARY_FUNCTIONS = {d.surface: op for op, d in OPS.items() if d.kind == OpKind.UNARY and d.surface}
VECTOR_FUNCTIONS = {d.surface: op for op, d in OPS.items() if d.kind == OpKind.VECTOR and d.surface}
BINARY_SYMBOLS = {
    d.surface: op for op, d in OPS.items() if d.kind == OpKind.BINARY and d.surface and not d.surface.isidentifier()
}
#: the functions the front end lowers from their entries alone (elementwise and row ops: `tanh(e)`, `dot(a, b)`)
CALLS = {
    d.surface: op
    for op, d in OPS.items()
    if d.kind in (OpKind.UNARY, OpKind.BINARY, OpKind.VECTOR) and d.surface and d.surface.isidentifier()
}
REDUCTIONS = {d.surface: op for op, d in OPS.items() if d.reduce is not None and d.surface}
#: functions of a per-child value that give a per-child value (normalised across the node's children)
CHILD_FUNCTIONS = {
    d.surface: op for op, d in OPS.items() if d.kind == OpKind.CHILDREN and d.reduce is None and d.surface
}

__all__ = [
    "BINARY_OPS",
    "BINARY_SYMBOLS",
    "CALLS",
    "CHILD_FUNCTIONS",
    "CHILD_READ_OPS",
    "ELEMENTWISE_OPS",
    "LEAF_OPS",
    "OPS",
    "REDUCE_OPS",
    "REDUCTIONS",
    "UNARY_FUNCTIONS",
    "UNARY_OPS",
    "VECTOR_FUNCTIONS",
    "VECTOR_OPS",
    "ChildReduce",
    "DType",
    "Derivatives",
    "Domain",
    "Emitter",
    "Identity",
    "NodeEnv",
    "Op",
    "OpDef",
    "OpKind",
    "Placement",
    "RowOp",
    "RowPass",
    "Shape",
    "ShapeError",
    "StepKind",
    "TypeContext",
    "broadcast_shape",
    "concat_shape",
    "expect",
    "float_literal",
    "fmt_shape",
    "matmul_shape",
    "pad_shape",
    "param_matrix",
    "param_views",
    "same_shape",
    "slice_offset",
    "slice_shape",
    "vector_shape",
    "width",
]
