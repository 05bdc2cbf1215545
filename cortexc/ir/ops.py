"""The operations of the cortexc IR and the rules every stage shares about them.

An op's *meaning* is its rule in `cortexc.ir.interp`; this module only says
what kind of op it is (so passes and code generators can dispatch on groups)
and how shapes and domains combine (so the checker, the lowering and the
verifier agree by construction).
"""

from __future__ import annotations

import enum

Shape = tuple[int, ...]


class Op(enum.Enum):
    # leaves of a body
    PARAM = "param"  # attrs: name
    INPUT = "input"  # attrs: name (float vector or int32 index)
    STATE = "state"  # attrs: name; the node's own state (read-outs only)
    CHILD_STATE = "child_state"  # attrs: name; one row per child (CHILD domain)
    CHILD_STATE_AT = "child_state_at"  # attrs: name, k; child k's state or 0 if missing
    HOISTED = "hoisted"  # attrs: name; this node's row of a result of the cell's `pre` body
    CONST = "const"  # attrs: value; a float scalar (broadcast by its users) or a filled vector/matrix
    # elementwise binary (scalars broadcast; NODE values broadcast against CHILD values)
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    # elementwise unary
    NEG = "neg"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    RELU = "relu"
    EXP = "exp"
    LOG = "log"
    ABS = "abs"
    SOFTPLUS = "softplus"
    # vector-wise
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    # structure
    MATMUL = "matmul"  # [M,K] @ [K] -> [M]; [M,K] @ [K,N] -> [M,N]
    SLICE = "slice"  # attrs: lo, hi; of a vector
    CONCAT = "concat"  # vectors end to end, matrices stacked by rows
    EMBED = "embed"  # args: param matrix, index input -> row
    # derivatives (made by `autodiff`, never written by users)
    ADJOINT = "adjoint"  # attrs: name; the incoming gradient of the body's result `name` for this node
    NUM_CHILDREN = "num_children"  # the node's number of children, as a float scalar
    TRANSPOSE = "transpose"  # [M, K] -> [K, M]
    OUTER = "outer"  # [M], [K] -> [M, K]
    STEP = "step"  # 1 where x > 0, else 0 (relu')
    SIGN = "sign"  # -1, 0 or 1 (abs')
    EQ = "eq"  # 1 where a == b, else 0 (which children hold a max)
    ROWSUM = "rowsum"  # sum of every element -> scalar
    PAD = "pad"  # attrs: lo, size; a slice put back in place, zeros elsewhere
    # children
    EXPAND = "expand"  # NODE/PARAM value -> the same value once per child
    SUM = "sum"  # CHILD -> NODE reductions over the children (0 with no child)
    MEAN = "mean"
    MAX = "max"


class Domain(enum.IntEnum):
    """Where a value varies: once per cell, once per node, or once per child of a node.

    Ordered so that the domain of an elementwise result is the max of its operands'.
    """

    PARAM = 0
    NODE = 1
    CHILD = 2


LEAF_OPS = frozenset(
    {Op.PARAM, Op.INPUT, Op.STATE, Op.CHILD_STATE, Op.CHILD_STATE_AT, Op.HOISTED, Op.CONST, Op.ADJOINT, Op.NUM_CHILDREN}
)
BINARY_OPS = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.EQ})
UNARY_OPS = frozenset({Op.NEG, Op.SIGMOID, Op.TANH, Op.RELU, Op.EXP, Op.LOG, Op.ABS, Op.SOFTPLUS, Op.STEP, Op.SIGN})
ELEMENTWISE_OPS = BINARY_OPS | UNARY_OPS
VECTOR_OPS = frozenset({Op.SOFTMAX, Op.LOG_SOFTMAX})
REDUCE_OPS = frozenset({Op.SUM, Op.MEAN, Op.MAX})
CHILD_READ_OPS = frozenset({Op.CHILD_STATE, Op.CHILD_STATE_AT, Op.NUM_CHILDREN})

#: surface names of the built-in functions, as written in a `.cell` file
UNARY_FUNCTIONS = {
    "sigmoid": Op.SIGMOID,
    "tanh": Op.TANH,
    "relu": Op.RELU,
    "exp": Op.EXP,
    "log": Op.LOG,
    "abs": Op.ABS,
    "softplus": Op.SOFTPLUS,
}
VECTOR_FUNCTIONS = {"softmax": Op.SOFTMAX, "log_softmax": Op.LOG_SOFTMAX}
REDUCTIONS = {"sum": Op.SUM, "mean": Op.MEAN, "max": Op.MAX}
BINARY_SYMBOLS = {"+": Op.ADD, "-": Op.SUB, "*": Op.MUL, "/": Op.DIV}


class ShapeError(Exception):
    """A shape rule is broken; the checker turns it into a located CellTypeError."""


def fmt_shape(shape: Shape) -> str:
    return "scalar" if not shape else "[" + ", ".join(str(d) for d in shape) + "]"


def broadcast_shape(a: Shape, b: Shape) -> Shape:
    """Elementwise operands must have equal shapes, or one is a scalar."""
    if a == b or not b:
        return a
    if not a:
        return b
    raise ShapeError(f"{fmt_shape(a)} and {fmt_shape(b)} differ")


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
