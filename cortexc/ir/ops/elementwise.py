"""The elementwise ops: each entry is its NumPy rule, shape rule, C text and derivative; the family
supplies the rest (type, interpreter and C rules, placement: inlined into the loops that read them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cortexc.ir.ops.base import (
    Derivatives,
    Domain,
    Emitter,
    Identity,
    NodeEnv,
    Op,
    OpDef,
    OpKind,
    Placement,
    Shape,
    ShapeError,
    fmt_shape,
    no_gradient,
)
from cortexc.runtime import philox

if TYPE_CHECKING:
    from cortexc.ir.cell import Value


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


def _batched(x: np.ndarray, value: Value, rank: int) -> np.ndarray:
    """A batched (leading-axis) operand lined up against results of `rank` trailing dims.

    NumPy aligns trailing axes, so a per-child scalar `[C]` next to a vector
    `[H]` must become `[C, 1]`; unbatched operands already line up.
    """
    if value.domain != Domain.CHILD or len(value.shape) >= rank:
        return x
    return x.reshape(x.shape[:1] + (1,) * (rank - len(value.shape)) + x.shape[1:])


def _entry(
    op: Op,
    kind: OpKind,
    surface: str | None,
    shape: Callable[..., Shape],
    numpy: Callable[..., np.ndarray],
    c: str,
    derivative,
    at_zero: float | None,
    **more: Any,
) -> OpDef:
    """An elementwise op's entry: its own rules, and the family's type, interpreter and C rules."""
    min_domain = more.get("min_domain", Domain.PARAM)
    identity = more.get("identity")
    c_identity = more.get("c_identity")

    def type_rule(ctx, value: Value, args: Sequence[Value]) -> tuple[Shape, Domain]:
        return shape(*(a.shape for a in args)), max(min_domain, *(a.domain for a in args))

    def interp(env: NodeEnv, value: Value, xs: list[np.ndarray], arg_values: Sequence[Value]) -> np.ndarray:
        if identity is not None:  # dropout: which element of which node (index = the node's id)
            children = len(env.children) if value.domain == Domain.CHILD else None
            where = Identity(env.dropout, env.index, children)
            with np.errstate(all="ignore"):
                return identity(xs[0], dict(value.attrs), where).astype(env.dtype, copy=False)
        if kind == OpKind.BINARY:
            rank = len(value.shape)
            xs = [_batched(x, v, rank) for x, v in zip(xs, arg_values)]
        with np.errstate(all="ignore"):  # IEEE results (inf, nan) at saturated inputs are the meaning, not news
            return numpy(*xs).astype(env.dtype, copy=False)

    def c_rule(e: Emitter, value: Value) -> str:
        operands = [e.arg(position) for position in range(len(value.args))]
        if c_identity is not None and not e.train:
            return operands[0]
        if c_identity is not None:  # the element's identity: its index, node id and child slot
            where = {"elem": e.col, "node": e.node(), "slot": e.slot()}
            return c.format(*operands, **where, **c_identity(dict(value.attrs)))
        text = more["c_inline"] if e.inline_gates and more.get("c_inline") else c
        return text.format(*operands)

    arity = 2 if kind == OpKind.BINARY else 1
    return OpDef(
        op,
        kind,
        surface,
        arity,
        type_rule,
        interp,
        derivative,
        Placement.ELEMENTWISE,
        c_rule,
        shape=shape,
        numpy=numpy,
        c=c,
        at_zero=at_zero,
        **more,
    )


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


_erf = np.vectorize(math.erf, otypes=[np.float64])  # NumPy has no erf; float64 then cast by the caller


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * math.sqrt(0.5)))


def _gelu_grad(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x * math.sqrt(0.5))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _sqrt(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN for negatives, quietly, as torch.sqrt
        return np.sqrt(x)


def _d_add(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield g
    yield g


def _d_sub(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield g
    yield d.op(Op.NEG, g)


def _d_mul(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    a, b = args
    yield d.op(Op.MUL, g, b)
    yield d.op(Op.MUL, g, a)


def _d_div(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    a, b = args
    yield d.op(Op.DIV, g, b)
    yield d.op(Op.NEG, d.op(Op.DIV, d.op(Op.MUL, g, y), b))


def _d_neg(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.NEG, g)


def _d_sigmoid(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.MUL, y, d.op(Op.SUB, d.const(1.0), y)))


def _d_tanh(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.SUB, d.const(1.0), d.op(Op.MUL, y, y)))


def _d_relu(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.STEP, args[0]))


def _d_exp(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, y)


def _d_log(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.DIV, g, args[0])


def _d_abs(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.SIGN, args[0]))


def _d_softplus(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.SIGMOID, args[0]))


def _d_gelu(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    yield d.op(Op.MUL, g, d.op(Op.GELU_GRAD, args[0]))


def _d_gelu_grad(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """gelu''(x) = phi(x) * (2 - x^2), phi the standard normal density."""
    (a,) = args
    square = d.op(Op.MUL, a, a)
    phi = d.op(Op.MUL, d.const(1.0 / math.sqrt(2.0 * math.pi)), d.op(Op.EXP, d.op(Op.MUL, d.const(-0.5), square)))
    yield d.op(Op.MUL, g, d.op(Op.MUL, phi, d.op(Op.SUB, d.const(2.0), square)))


def _d_silu(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x): 1 - s is exactly 0 for large x, so x (1 - s) is
    too, and the derivative 1 (not `1 + x - y`, which cancels to 0 at 1e30 in float32)."""
    (a,) = args
    s = d.op(Op.SIGMOID, a)
    yield d.op(Op.MUL, g, d.op(Op.MUL, s, d.op(Op.ADD, d.const(1.0), d.op(Op.MUL, a, d.op(Op.SUB, d.const(1.0), s)))))


def _d_sqrt(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """g / (2 sqrt(x)), as torch: infinite at 0 (NaN where g is 0 too)."""
    yield d.op(Op.DIV, g, d.op(Op.MUL, d.const(2.0), y))


#: the variance's epsilon of `layernorm`, as torch.nn.functional.layer_norm's default
LAYERNORM_EPS = 1e-5

#: 1 / sqrt(var + eps), and 0 for an infinite variance (a row whose squares overflow float32, as the
#: interpreter's): fast-math's vectorised sqrt is x * rsqrt(x) and its reciprocal a Newton step, NaN at inf,
#: so inf is told by its bits
RSTD_HELPER = (
    "float cx_rstd(float x) { unsigned bits; __builtin_memcpy(&bits, &x, 4);"
    f" return bits == 0x7f800000u ? 0.0f : 1.0f / sqrtf(x + {LAYERNORM_EPS!r}f); }}"
)


def _rstd(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN below -eps, quietly, as torch.rsqrt
        return 1.0 / np.sqrt(x + LAYERNORM_EPS)


def _d_rstd(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """-(x + eps)^(-3/2) / 2 = -y^3 / 2."""
    yield d.op(Op.MUL, g, d.op(Op.MUL, d.const(-0.5), d.op(Op.MUL, y, d.op(Op.MUL, y, y))))


def _d_minimum(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """To the smaller operand; on a tie, half to each (as torch.minimum)."""
    a, b = args
    tie = d.op(Op.MUL, d.const(0.5), d.op(Op.EQ, a, b))
    yield d.op(Op.MUL, g, d.op(Op.ADD, d.op(Op.STEP, d.op(Op.SUB, b, a)), tie))
    yield d.op(Op.MUL, g, d.op(Op.ADD, d.op(Op.STEP, d.op(Op.SUB, a, b)), tie))


def _d_maximum(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
    """To the larger operand; on a tie, half to each (as torch.maximum)."""
    a, b = args
    tie = d.op(Op.MUL, d.const(0.5), d.op(Op.EQ, a, b))
    yield d.op(Op.MUL, g, d.op(Op.ADD, d.op(Op.STEP, d.op(Op.SUB, a, b)), tie))
    yield d.op(Op.MUL, g, d.op(Op.ADD, d.op(Op.STEP, d.op(Op.SUB, b, a)), tie))


def _d_dropout(d: Derivatives, g: int, y: int, args: Sequence[int], value: Value) -> Iterator[int | None]:
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

_U, _B = OpKind.UNARY, OpKind.BINARY

#: the elementwise ops, in the order their C helpers are emitted
ELEMENTWISE: tuple[OpDef, ...] = (
    _entry(Op.ADD, _B, "+", broadcast_shape, np.add, "({0} + {1})", _d_add, 0.0, zero_identity=(0, 1)),
    _entry(Op.SUB, _B, "-", broadcast_shape, np.subtract, "({0} - {1})", _d_sub, 0.0, zero_identity=(1,)),
    _entry(Op.MUL, _B, "*", broadcast_shape, np.multiply, "({0} * {1})", _d_mul, 0.0, zero_absorbs=(0, 1)),
    _entry(Op.DIV, _B, "/", broadcast_shape, np.divide, "({0} / {1})", _d_div, None, zero_absorbs=(0,)),
    _entry(Op.NEG, _U, None, same_shape, np.negative, "(-{0})", _d_neg, 0.0),
    _entry(
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
    _entry(
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
    _entry(Op.RELU, _U, "relu", same_shape, lambda x: np.maximum(x, 0), "fmaxf({0}, 0.0f)", _d_relu, 0.0),
    _entry(Op.EXP, _U, "exp", same_shape, np.exp, "expf({0})", _d_exp, 1.0),
    _entry(Op.LOG, _U, "log", same_shape, np.log, "logf({0})", _d_log, None),
    _entry(Op.ABS, _U, "abs", same_shape, np.abs, "fabsf({0})", _d_abs, 0.0),
    _entry(
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
    _entry(
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
    _entry(
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
    _entry(
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
    _entry(Op.RSTD, _U, None, same_shape, _rstd, "cx_rstd({0})", _d_rstd, None, c_helper=RSTD_HELPER),
    _entry(Op.MINIMUM, _B, "minimum", broadcast_shape, np.minimum, "fminf({0}, {1})", _d_minimum, 0.0),
    _entry(Op.MAXIMUM, _B, "maximum", broadcast_shape, np.maximum, "fmaxf({0}, {1})", _d_maximum, 0.0),
    _entry(
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
    _entry(
        Op.STEP,
        _U,
        None,
        same_shape,
        lambda x: (x > 0).astype(x.dtype),
        "({0} > 0.0f ? 1.0f : 0.0f)",
        no_gradient,
        0.0,
    ),
    _entry(
        Op.SIGN,
        _U,
        None,
        same_shape,
        np.sign,
        "cx_sign({0})",
        no_gradient,
        0.0,
        c_helper="float cx_sign(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }",
    ),
    _entry(
        Op.EQ,
        _B,
        None,
        broadcast_shape,
        lambda a, b: np.equal(a, b).astype(np.result_type(a, b)),
        "({0} == {1} ? 1.0f : 0.0f)",
        no_gradient,
        1.0,
    ),
    _entry(
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
