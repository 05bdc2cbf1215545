"""The operations of the cortexc IR, and every rule stages share about them.

Each elementwise and vector op is defined once, in `OPS`, as JAX's ``lax.py``
keeps a primitive's rules side by side: its surface name, arity, shape rule,
interpreter rule (NumPy), C/CUDA text (and the C helper that text calls),
derivative and value at zero. The interpreter, the code generators, autodiff,
specialisation and the front end all read that one entry, so a new function
is one `Op` member plus one `OpDef`. The other ops move data or shapes
(`STRUCTURAL_OPS`): each stage handles them itself. The IR imports neither
passes nor codegen: the entries hold data and small functions only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cortexc.runtime import philox
from cortexc.runtime.philox import Dropout

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
    GELU = "gelu"
    SILU = "silu"
    SQRT = "sqrt"
    DROPOUT = "dropout"  # attrs: site, p; e in evaluation mode, else kept or zeroed by the element's identity
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
    SAVED = "saved"  # attrs: name, column; a value the training forward kept for this node (`passes.saving`)
    NUM_CHILDREN = "num_children"  # the node's number of children, as a float scalar
    TRANSPOSE = "transpose"  # [M, K] -> [K, M]
    OUTER = "outer"  # [M], [K] -> [M, K]
    STEP = "step"  # 1 where x > 0, else 0 (relu')
    SIGN = "sign"  # -1, 0 or 1 (abs')
    EQ = "eq"  # 1 where a == b, else 0 (which children hold a max)
    GELU_GRAD = "gelu_grad"  # gelu'(x) = Phi(x) + x * phi(x)
    ROWSUM = "rowsum"  # sum of every element -> scalar, or [1] (the gradient of a broadcast [1] operand)
    PAD = "pad"  # attrs: lo, size; a slice put back in place, zeros elsewhere
    # children
    EXPAND = "expand"  # NODE/PARAM value -> the same value once per child
    SUM = "sum"  # CHILD -> NODE reductions over the children (0 with no child)
    MEAN = "mean"
    MAX = "max"
    CHILD_SOFTMAX = "child_softmax"  # CHILD -> CHILD: softmax across the node's children, per component


class Domain(enum.IntEnum):
    """Where a value varies: once per cell, once per node, or once per child of a node.

    Ordered so that the domain of an elementwise result is the max of its operands'.
    """

    PARAM = 0
    NODE = 1
    CHILD = 2


class ShapeError(Exception):
    """A shape rule is broken; the checker turns it into a located CellTypeError."""


def fmt_shape(shape: Shape) -> str:
    return "scalar" if not shape else "[" + ", ".join(str(d) for d in shape) + "]"


def broadcast_shape(a: Shape, b: Shape) -> Shape:
    """Elementwise operands must have equal shapes, or one is a scalar or a `[1]` vector (which broadcasts
    exactly as a scalar does: a per-child score `[1]` weights a per-child state `[H]`)."""
    if a == b or not b:
        return a
    if not a:
        return b
    if a == (1,):
        return b
    if b == (1,):
        return a
    raise ShapeError(f"{fmt_shape(a)} and {fmt_shape(b)} differ")


def same_shape(a: Shape) -> Shape:
    """A unary elementwise op keeps its operand's shape."""
    return a


def vector_shape(a: Shape) -> Shape:
    """A vector op (softmax) takes a vector and keeps its shape."""
    if len(a) != 1:
        raise ShapeError(f"takes a vector, not {fmt_shape(a)}")
    return a


# ----------------------------------------------------------------------------- the op registry


class OpKind(enum.Enum):
    UNARY = "unary"  # elementwise, one operand
    BINARY = "binary"  # elementwise, two operands (scalars broadcast)
    VECTOR = "vector"  # the whole vector at once (softmax); lowered to a row loop, not an expression


class Derivatives(Protocol):
    """What a derivative rule may build (autodiff implements it over the GRAD body being built).

    Values are indices into that body; `op` takes an elementwise op (shape and
    domain follow its operands), `rowsum` sums a vector to a scalar.
    """

    def op(self, op: Op, *args: int) -> int: ...

    def const(self, number: float) -> int: ...

    def rowsum(self, x: int) -> int: ...

    def mask(self, y: int) -> int:
        """The mask a dropout value `y` was made with (per element: its scale where kept, else 0)."""
        ...


@dataclass(frozen=True)
class Identity:
    """Which elements of one node's value an identity-dependent rule (dropout) sees: the call's dropout
    mode, the node's id, and for a per-child value how many children it has rows for (slots 1..children)."""

    dropout: Dropout
    node: int
    children: int | None  # None: a per-node value (slot 0)


#: ``rule(x, attrs, identity)``: the interpreter rule of an op whose result depends on its elements' identity
IdentityRule = Callable[[np.ndarray, Mapping[str, Any], Identity], np.ndarray]


#: ``rule(d, g, y, args)``: given the adjoint ``g`` of ``y = op(*args)``, yield one contribution per
#: argument, in argument order (None: nothing flows to it). A generator, so that each contribution is
#: built just before autodiff adds it to its argument's adjoint.
DerivativeRule = Callable[[Derivatives, int, int, Sequence[int]], Iterator[int | None]]


@dataclass(frozen=True)
class OpDef:
    """Everything about one elementwise or vector op.

    ``c`` is the C/CUDA text (the same for both): for an elementwise op, over
    its operands' expressions ``{0}``, ``{1}``; for a vector op, element ``j``
    of the result row from ``{0}`` (element ``j`` of the argument), ``top``
    (the row's max), ``total`` (the sum of ``expf({0} - top)``) and
    ``out_row[j]`` (which holds ``expf({0} - top)``), after ``c_row_setup``
    ran once for the row. ``c_helper`` defines a function that ``c`` calls
    (emitted once in every kernel file whose program uses the op, with the
    target's qualifiers in front).
    ``at_zero`` is the value with every operand zero (None: not a constant;
    specialisation then computes the op on an explicit zero).
    An op whose result depends on which element of which node it is (dropout) has an ``identity``
    rule (the interpreter's, given the node's `Identity`; ``numpy`` is then its evaluation-mode rule),
    ``c_identity`` (its attrs as the named fields of ``c``, besides ``{elem}``, ``{node}`` and ``{slot}``,
    the C expressions of the element index, node id and child slot that codegen fills in),
    ``c_helper_needs`` (helpers its helper calls, emitted before it) and ``min_domain`` (its result
    varies at least per node, whatever its operands).
    ``c_inline`` and ``c_inline_helper`` (a gate's C text and helper without a libm call) are what an
    inference kernel that computes the gates of all its rows at once (``Kernel.inline_gates``: the
    direct node kernel) uses instead: no training forward or gradient kernel reads them.
    """

    op: Op
    kind: OpKind
    surface: str | None  # the function name or operator symbol a .cell file writes; None: made by passes
    # (or, for `neg`, written as unary minus, which the front end reads itself)
    shape: Callable[..., Shape]
    numpy: Callable[..., np.ndarray]
    c: str
    derivative: DerivativeRule
    at_zero: float | None
    c_helper: str = ""
    c_row_setup: str = ""
    identity: IdentityRule | None = None
    c_identity: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = None
    c_helper_needs: tuple[str, ...] = ()
    min_domain: Domain = Domain.PARAM
    c_inline: str = ""
    c_inline_helper: str = ""
    c_inline_needs: tuple[str, ...] = ()

    @property
    def arity(self) -> int:
        return 2 if self.kind == OpKind.BINARY else 1


#: tanh without libm, for the inference kernel whose gate loops were a third of a chain LSTM's time in
#: libmvec's calls (Zen 4, B=100): x times an even rational of degrees 12/6 in x (the coefficients of a
#: minimax fit, as Eigen's fast tanh has them), within 8 ulps of float64 below 7.905 and exactly +-1 from
#: there (float32's tanh is 1 - 2.4e-7 at 7.905 and 1 from 9.011). No clamp: beyond 7.905 the rational's
#: value (inf / inf for a huge x) is not selected. NaN is told by its bits (-ffinite-math-only lets gcc
#: swap any float select, and a clamp `a > C ? C : a` became a min giving C for NaN): test_inline_gates.
_TANH_INLINE = (
    "float cx_tanh_inline(float x) {"
    " const float x2 = x * x;"
    " float p = fmaf(-2.76076847742355e-16f, x2, 2.00018790482477e-13f);"
    " p = fmaf(p, x2, -8.60467152213735e-11f); p = fmaf(p, x2, 5.12229709037114e-08f);"
    " p = fmaf(p, x2, 1.48572235717979e-05f); p = fmaf(p, x2, 6.37261928875436e-04f);"
    " p = fmaf(p, x2, 4.89352455891786e-03f);"
    " float q = fmaf(1.19825839466702e-06f, x2, 1.18534705686654e-04f);"
    " q = fmaf(q, x2, 2.26843463243900e-03f); q = fmaf(q, x2, 4.89352518554385e-03f);"
    " const float t = fabsf(x) >= 7.9053111f ? copysignf(1.0f, x) : x * p / q;"
    " unsigned bits; __builtin_memcpy(&bits, &x, 4); return (bits & 0x7fffffffu) > 0x7f800000u ? x : t; }"
)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


_erf = np.vectorize(math.erf, otypes=[np.float64])  # NumPy has no erf; float64 then cast by the caller


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * math.sqrt(0.5)))


def _gelu_grad(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x * math.sqrt(0.5))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _sqrt(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN for negatives, quietly, as torch.sqrt
        return np.sqrt(x)


def _no_gradient(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    """Piecewise constant (step, sign, eq): the derivative is 0 wherever it exists."""
    for _ in args:
        yield None


def _d_add(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield g
    yield g


def _d_sub(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield g
    yield d.op(Op.NEG, g)


def _d_mul(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    a, b = args
    yield d.op(Op.MUL, g, b)
    yield d.op(Op.MUL, g, a)


def _d_div(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    a, b = args
    yield d.op(Op.DIV, g, b)
    yield d.op(Op.NEG, d.op(Op.DIV, d.op(Op.MUL, g, y), b))


def _d_neg(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.NEG, g)


def _d_sigmoid(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.MUL, y, d.op(Op.SUB, d.const(1.0), y)))


def _d_tanh(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.SUB, d.const(1.0), d.op(Op.MUL, y, y)))


def _d_relu(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.STEP, args[0]))


def _d_exp(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, y)


def _d_log(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.DIV, g, args[0])


def _d_abs(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.SIGN, args[0]))


def _d_softplus(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.SIGMOID, args[0]))


def _d_gelu(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.GELU_GRAD, args[0]))


def _d_gelu_grad(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    """gelu''(x) = phi(x) * (2 - x^2), phi the standard normal density."""
    (a,) = args
    square = d.op(Op.MUL, a, a)
    phi = d.op(Op.MUL, d.const(1.0 / math.sqrt(2.0 * math.pi)), d.op(Op.EXP, d.op(Op.MUL, d.const(-0.5), square)))
    yield d.op(Op.MUL, g, d.op(Op.MUL, phi, d.op(Op.SUB, d.const(2.0), square)))


def _d_silu(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    """silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x): 1 - s is exactly 0 for large x, so x (1 - s) is
    too, and the derivative 1 (not `1 + x - y`, which cancels to 0 at 1e30 in float32)."""
    (a,) = args
    s = d.op(Op.SIGMOID, a)
    yield d.op(Op.MUL, g, d.op(Op.MUL, s, d.op(Op.ADD, d.const(1.0), d.op(Op.MUL, a, d.op(Op.SUB, d.const(1.0), s)))))


def _d_sqrt(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    """g / (2 sqrt(x)), as torch: infinite at 0 (NaN where g is 0 too)."""
    yield d.op(Op.DIV, g, d.op(Op.MUL, d.const(2.0), y))


def _d_softmax(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    dot = d.rowsum(d.op(Op.MUL, g, y))
    yield d.op(Op.MUL, y, d.op(Op.SUB, g, dot))


def _d_log_softmax(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    total = d.rowsum(g)
    yield d.op(Op.SUB, g, d.op(Op.MUL, d.op(Op.EXP, y), total))


def _d_dropout(d: Derivatives, g: int, y: int, args: Sequence[int]) -> Iterator[int | None]:
    """The forward's mask and scale on the gradient (the same site and elements: dropout of g)."""
    yield d.op(Op.MUL, g, d.mask(y))


def _dropout(x: np.ndarray, attrs: Mapping[str, Any], where: Identity) -> np.ndarray:
    """Masks from `cortexc.runtime.philox`, for one node's value (rows of children: slots 1, 2, ...)."""
    if not where.dropout.train:
        return x
    p = attrs["p"]
    shape = x.shape if where.children is None else x.shape[1:]
    element = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    slot: np.ndarray | int = 0
    if where.children is not None:
        slot = (1 + np.arange(where.children, dtype=np.int64)).reshape((-1,) + (1,) * len(shape))
    keep = philox.keep_mask(where.dropout.seed, attrs["site"], p, where.node, slot, element)
    scale = np.asarray(philox.scale(p), x.dtype)
    return np.where(keep, x * scale, np.zeros((), x.dtype)).astype(x.dtype, copy=False)


def _c_dropout(attrs: Mapping[str, Any]) -> Mapping[str, str]:
    scale = float(philox.scale(attrs["p"]))
    return {"site": f"{attrs['site']}u", "threshold": f"{philox.threshold(attrs['p'])}u", "scale": f"{scale!r}f"}


#: Philox-4x32-10's first output word (counter c0..c3, key k0, k1): the kernels' mask function, one helper for
#: C and CUDA; the NumPy one is `philox4x32`. Every word is held zero-extended in 64 bits and each product is a
#: widening 32 x 32 -> 64 one (vpmuludq when gcc vectorises the loop; mul.wide.u32 in nvcc): with 32-bit
#: words gcc repacks the lanes every round and multiplies in full 64 bits (~20% slower).
_PHILOX_HELPER = (
    "uint32_t cx_philox_u0(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {"
    " uint64_t c0 = a0, c1 = a1, c2 = a2, c3 = a3, k0 = b0, k1 = b1;"
    " for (int r = 0; r < 10; ++r) {"
    " const uint64_t p0 = 0xD2511F53u * c0, p1 = 0xCD9E8D57u * c2;"
    " const uint64_t n0 = ((p1 >> 32) ^ c1 ^ k0) & 0xFFFFFFFFu, n2 = ((p0 >> 32) ^ c3 ^ k1) & 0xFFFFFFFFu;"
    " c1 = p1 & 0xFFFFFFFFu; c3 = p0 & 0xFFFFFFFFu; c0 = n0; c2 = n2;"
    " k0 = (k0 + 0x9E3779B9u) & 0xFFFFFFFFu; k1 = (k1 + 0xBB67AE85u) & 0xFFFFFFFFu; }"  # bumped after each round
    " return (uint32_t)c0; }"
)

_SQRT1_2 = "0.70710678118654752f"  # 1 / sqrt(2)
_INV_SQRT_2PI = "0.39894228040143268f"  # 1 / sqrt(2 pi)

_U, _B, _V = OpKind.UNARY, OpKind.BINARY, OpKind.VECTOR

#: the elementwise and vector ops, in the order their C helpers are emitted
OPS: dict[Op, OpDef] = {
    d.op: d
    for d in (
        OpDef(Op.ADD, _B, "+", broadcast_shape, np.add, "({0} + {1})", _d_add, 0.0),
        OpDef(Op.SUB, _B, "-", broadcast_shape, np.subtract, "({0} - {1})", _d_sub, 0.0),
        OpDef(Op.MUL, _B, "*", broadcast_shape, np.multiply, "({0} * {1})", _d_mul, 0.0),
        OpDef(Op.DIV, _B, "/", broadcast_shape, np.divide, "({0} / {1})", _d_div, None),
        OpDef(Op.NEG, _U, None, same_shape, np.negative, "(-{0})", _d_neg, 0.0),
        OpDef(
            Op.SIGMOID,
            _U,
            "sigmoid",
            same_shape,
            _sigmoid,
            "cx_sigmoid({0})",
            _d_sigmoid,
            0.5,
            # exp(-|x|) is in [0, 1]: never the 1 / (1 + inf) that fast-math's vectorised reciprocal turns to NaN;
            # for x >= 0, 1 - t with t = e / (1 + e), not the reciprocal itself, whose rcp + Newton step gives
            # 0.99999994 for 1 / 1 (then 1 - s is not 0 for a saturated x: silu's derivative at 1e30)
            c_helper=(
                "float cx_sigmoid(float x) { const float e = expf(-fabsf(x)), t = e * (1.0f / (1.0f + e));"
                " return x >= 0.0f ? 1.0f - t : t; }"
            ),
            # inline: (1 + tanh(x / 2)) / 2 by the inline tanh above; within 2e-7 of float64 absolutely (not
            # relatively in the far negative tail: 0 from x = -15.81, where sigmoid is 1.4e-7), exactly 0
            # and 1 beyond +-15.81
            c_inline="cx_sigmoid_inline({0})",
            c_inline_helper="float cx_sigmoid_inline(float x) { return fmaf(0.5f, cx_tanh_inline(0.5f * x), 0.5f); }",
            c_inline_needs=(_TANH_INLINE,),
        ),
        OpDef(
            Op.TANH,
            _U,
            "tanh",
            same_shape,
            np.tanh,
            "cx_tanh({0})",
            _d_tanh,
            0.0,
            # libm's tanhf, vectorised by libmvec, but exactly +-1 where float32's tanh is (|x| >= 9.010914):
            # the 16-lane build (-mprefer-vector-width=512) gave 0.99999994 at 9.5, and 1 - tanh^2 must be 0
            # there as the interpreter's is. An exp-based tanh, rounded as float32's own near saturation
            # (99.96% in [3, 10], against libmvec's 59-73%, within 1 ulp either way), was 4-8% slower. Saturated,
            # the result is made from t itself (t (2 - |t|) by one fma: exactly +-1 for |t| within a few ulps of
            # 1, NaN for NaN), so NaN passes through whichever way -ffinite-math-only turns the select (it once
            # became `|x| < 9.01 ? t : +-1`, and NaN gave 1). Float ops only: a test on the bits of |x| changed
            # how gcc vectorised the 16-column loops of a split level, so 1 and 2 threads differed (SST, H=256)
            c_helper=(
                "float cx_tanh(float x) { const float t = tanhf(x);"
                " return fabsf(x) >= 9.010914f ? fmaf(-t, fabsf(t), 2.0f * t) : t; }"
            ),
            c_inline="cx_tanh_inline({0})",
            c_inline_helper=_TANH_INLINE,
        ),
        OpDef(Op.RELU, _U, "relu", same_shape, lambda x: np.maximum(x, 0), "fmaxf({0}, 0.0f)", _d_relu, 0.0),
        OpDef(Op.EXP, _U, "exp", same_shape, np.exp, "expf({0})", _d_exp, 1.0),
        OpDef(Op.LOG, _U, "log", same_shape, np.log, "logf({0})", _d_log, None),
        OpDef(Op.ABS, _U, "abs", same_shape, np.abs, "fabsf({0})", _d_abs, 0.0),
        OpDef(
            Op.SOFTPLUS,
            _U,
            "softplus",
            same_shape,
            lambda x: np.logaddexp(0, x),
            "cx_softplus({0})",
            _d_softplus,
            math.log(2.0),
            c_helper="float cx_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }",
        ),
        OpDef(
            Op.GELU,
            _U,
            "gelu",
            same_shape,
            _gelu,
            "cx_gelu({0})",
            _d_gelu,
            0.0,
            c_helper=f"float cx_gelu(float x) {{ return 0.5f * x * (1.0f + erff(x * {_SQRT1_2})); }}",
        ),
        OpDef(
            Op.SILU,
            _U,
            "silu",
            same_shape,
            lambda x: x * _sigmoid(x),
            "cx_silu({0})",
            _d_silu,
            0.0,
            c_helper=(  # x * sigmoid(x), the sigmoid as cx_sigmoid's (no inf in a denominator, exactly 1 saturated)
                "float cx_silu(float x) { const float e = expf(-fabsf(x)), t = e * (1.0f / (1.0f + e));"
                " return x * (x >= 0.0f ? 1.0f - t : t); }"
            ),
        ),
        OpDef(
            Op.SQRT,
            _U,
            "sqrt",
            same_shape,
            _sqrt,
            "cx_sqrt({0})",
            _d_sqrt,
            0.0,
            # fast-math's vectorised sqrt is x * rsqrt(x): NaN at inf (inf * 0), so inf is passed through
            c_helper="float cx_sqrt(float x) { return x < FLT_MAX ? sqrtf(x) : x; }",
        ),
        OpDef(
            Op.DROPOUT,
            _U,
            None,  # dropout(e, p): read by the front end itself (p is a constant, not an operand)
            same_shape,
            lambda x: x,  # evaluation mode
            "cx_dropout({0}, call->dropout_train, call->dropout_seed, {elem}, {node}, {slot}, {site}, {threshold},"
            " {scale})",
            _d_dropout,
            0.0,
            # evaluation mode computes exactly x (one branch on the call's flag); the counter is (e, n, j, s)
            c_helper=(
                "float cx_dropout(float x, int64_t train, uint64_t seed, int64_t e, int64_t n, int64_t j, uint32_t s,"
                " uint32_t threshold, float scale) { if (!train) return x;"
                " return cx_philox_u0((uint32_t)e, (uint32_t)n, (uint32_t)j, s, (uint32_t)seed,"
                " (uint32_t)(seed >> 32)) >= threshold ? x * scale : 0.0f; }"
            ),
            identity=_dropout,
            c_identity=_c_dropout,
            c_helper_needs=(_PHILOX_HELPER,),
            min_domain=Domain.NODE,
        ),
        OpDef(Op.SOFTMAX, _V, "softmax", vector_shape, _softmax, "out_row[j] / total", _d_softmax, None),
        OpDef(
            Op.LOG_SOFTMAX,
            _V,
            "log_softmax",
            vector_shape,
            _log_softmax,
            "{0} - top - log_total",
            _d_log_softmax,
            None,
            c_row_setup="const float log_total = logf(total);",
        ),
        OpDef(
            Op.STEP,
            _U,
            None,
            same_shape,
            lambda x: (x > 0).astype(x.dtype),
            "({0} > 0.0f ? 1.0f : 0.0f)",
            _no_gradient,
            0.0,
        ),
        OpDef(
            Op.SIGN,
            _U,
            None,
            same_shape,
            np.sign,
            "cx_sign({0})",
            _no_gradient,
            0.0,
            c_helper="float cx_sign(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }",
        ),
        OpDef(
            Op.EQ,
            _B,
            None,
            broadcast_shape,
            lambda a, b: np.equal(a, b).astype(np.result_type(a, b)),
            "({0} == {1} ? 1.0f : 0.0f)",
            _no_gradient,
            1.0,
        ),
        OpDef(
            Op.GELU_GRAD,
            _U,
            None,
            same_shape,
            _gelu_grad,
            "cx_gelu_grad({0})",
            _d_gelu_grad,
            0.5,
            c_helper=(
                f"float cx_gelu_grad(float x) {{ return 0.5f * (1.0f + erff(x * {_SQRT1_2}))"
                f" + {_INV_SQRT_2PI} * x * expf(-0.5f * x * x); }}"
            ),
        ),
    )
}

#: the ops with no operands: values read from parameters, inputs, states, constants and the gradient's seeds
LEAF_OPS = frozenset(
    {
        Op.PARAM,
        Op.INPUT,
        Op.STATE,
        Op.CHILD_STATE,
        Op.CHILD_STATE_AT,
        Op.HOISTED,
        Op.CONST,
        Op.ADJOINT,
        Op.SAVED,
        Op.NUM_CHILDREN,
    }
)

#: the ops that move data or shapes rather than compute numbers: every stage handles each one itself
STRUCTURAL_OPS = LEAF_OPS | {
    Op.MATMUL,
    Op.SLICE,
    Op.CONCAT,
    Op.EMBED,
    Op.TRANSPOSE,
    Op.OUTER,
    Op.ROWSUM,
    Op.PAD,
    Op.EXPAND,
    Op.SUM,
    Op.MEAN,
    Op.MAX,
    Op.CHILD_SOFTMAX,
}

BINARY_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.BINARY)
UNARY_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.UNARY)
ELEMENTWISE_OPS = BINARY_OPS | UNARY_OPS
VECTOR_OPS = frozenset(op for op, d in OPS.items() if d.kind == OpKind.VECTOR)
REDUCE_OPS = frozenset({Op.SUM, Op.MEAN, Op.MAX})
CHILD_READ_OPS = frozenset({Op.CHILD_STATE, Op.CHILD_STATE_AT, Op.NUM_CHILDREN})

#: surface names of the built-in functions and operators, as written in a `.cell` file
UNARY_FUNCTIONS = {d.surface: op for op, d in OPS.items() if d.kind == OpKind.UNARY and d.surface}
VECTOR_FUNCTIONS = {d.surface: op for op, d in OPS.items() if d.kind == OpKind.VECTOR and d.surface}
BINARY_SYMBOLS = {d.surface: op for op, d in OPS.items() if d.kind == OpKind.BINARY and d.surface}
REDUCTIONS = {"sum": Op.SUM, "mean": Op.MEAN, "max": Op.MAX}
#: functions of a per-child value that give a per-child value (normalised across the node's children)
CHILD_FUNCTIONS = {"child_softmax": Op.CHILD_SOFTMAX}


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
