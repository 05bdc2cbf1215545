"""The op registry (`cortexc.ir.ops.OPS`): every op fully defined, and every op against torch.

- Every `Op` is a registry entry with every part its family needs (structural ops too).
- Every user-writable function and operator, in one cell (one op per state, one input per operand):
  forward and backward in the interpreter, the compiled C (``cpu``) and the emitted CUDA emulated on
  the CPU (``cuda-emu``), against torch's own function in float64, with saturated and large inputs.
- The ops only passes make (``step``, ``sign``, ``eq``, ``gelu_grad``): their NumPy rule and derivative
  against torch through hand-built cells; the compiled code reaches them through their users' gradients.
"""

from __future__ import annotations

import inspect
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest, reference
from cortexc.frontend import lower_source
from cortexc.ir.ops import OPS, Domain, Op, OpKind, Placement, StepKind
from cortexc.passes.autodiff import autodiff
from cortexc.passes.specialize import specialize
from tests.helpers import nvcc_compile as nvcc

torch = pytest.importorskip("torch")
F = torch.nn.functional

H = 8


# --------------------------------------------------------------------------- completeness


def test_every_op_is_in_the_registry():
    assert set(OPS) == set(Op), set(Op) - set(OPS)


#: the families whose entries are spelled as NumPy rule, shape rule and C text (the rest: rules of their own)
FUNCTIONAL = (OpKind.UNARY, OpKind.BINARY, OpKind.VECTOR)


@pytest.mark.parametrize("op", list(OPS), ids=lambda op: op.value)
def test_every_registry_entry_has_every_part(op):
    d = OPS[op]
    assert d.op == op
    assert callable(d.type_rule) and callable(d.interp) and callable(d.c_rule)
    assert inspect.isgeneratorfunction(d.derivative), "a derivative rule yields one contribution per argument"
    assert d.at_zero is None or isinstance(d.at_zero, float)
    assert (d.placement == Placement.STEP) == (d.step is not None)
    assert (d.step == StepKind.ROW) == (d.row is not None), "a row step renders the entry's RowOp"
    assert (d.step == StepKind.REDUCE) == (d.reduce is not None)
    assert (d.kind == OpKind.LEAF) == (d.arity == 0)
    if d.kind not in FUNCTIONAL or d.kind == OpKind.VECTOR:
        return
    assert callable(d.shape) and callable(d.numpy)
    # an elementwise op's C text uses each operand; every helper it calls is defined by the entry
    assert all(f"{{{i}}}" in d.c for i in range(d.arity)), d.c
    if d.c_identity is not None:  # the element's identity: named fields codegen fills in, the attrs' own
        assert d.identity is not None and d.min_domain == Domain.NODE
        fields = {"elem": "j", "node": "nd[i]", "slot": "0", **d.c_identity({"site": 1, "p": 0.5})}
        assert d.c.format(*["x"] * d.arity, **fields)
        for helper in set(re.findall(r"\bcx_\w+(?=\()", d.c + d.c_helper)):
            defined = [h for h in (*d.c_helper_needs, d.c_helper) if re.match(rf"\w+ {helper}\(.*\}}$", h)]
            assert len(defined) == 1, (helper, d.c_helper)
        return
    assert d.c.format(*["x"] * d.arity)
    for helper in set(re.findall(r"\bcx_\w+(?=\()", d.c)):
        assert re.match(rf"float {helper}\(float x\) \{{.*\}}$", d.c_helper), (helper, d.c_helper)
    assert d.shape(*[(H,)] * d.arity) == (H,)


@pytest.mark.parametrize("op", [op for op, d in OPS.items() if d.row is not None and d.shape], ids=lambda op: op.value)
def test_every_row_op_takes_vectors_only(op):
    with pytest.raises(Exception, match="vector"):
        OPS[op].shape(*[(2, 3)] * (OPS[op].arity or 1))


def test_surface_names_are_unique_and_reach_the_front_end():
    from cortexc.frontend.lower import FUNCTIONS
    from cortexc.ir.ops import BINARY_SYMBOLS, CALLS

    surfaces = [d.surface for d in OPS.values() if d.surface]
    assert len(surfaces) == len(set(surfaces))
    assert {d.surface: op for op, d in OPS.items() if d.surface and d.kind in FUNCTIONAL} == {
        **CALLS,
        **BINARY_SYMBOLS,
    }
    assert set(CALLS) <= set(FUNCTIONS)  # the front end's list for "did you mean"
    assert {"gelu", "silu", "sqrt", "minimum", "maximum", "dot", "layernorm"} <= set(CALLS)


@pytest.mark.parametrize(
    "op", [op for op, d in OPS.items() if d.at_zero is not None and d.numpy is not None], ids=lambda op: op.value
)
def test_value_at_zero_is_the_rule_at_zero(op):
    d = OPS[op]
    zeros = [np.zeros(H)] * d.arity
    assert np.all(d.numpy(*zeros) == d.at_zero)


# --------------------------------------------------------------------------- every op, every path

#: name -> (expression over the op's inputs, the inputs' kinds, the torch function)
#: input kinds: "real" (any value, saturated ones included), "exp" (within float32 exp's range),
#: "positive" (log, sqrt), "divisor" (away from 0)
USER_OPS = {
    "add": ("x_add + y_add", ("real", "real"), lambda x, y: x + y),
    "sub": ("x_sub - y_sub", ("real", "real"), lambda x, y: x - y),
    "mul": ("x_mul * y_mul", ("real", "real"), lambda x, y: x * y),
    "div": ("x_div / y_div", ("real", "divisor"), lambda x, y: x / y),
    "neg": ("-x_neg", ("real",), lambda x: -x),
    "sigmoid": ("sigmoid(x_sigmoid)", ("real",), torch.sigmoid),
    "tanh": ("tanh(x_tanh)", ("real",), torch.tanh),
    "relu": ("relu(x_relu)", ("real",), F.relu),
    "exp": ("exp(x_exp)", ("exp",), torch.exp),
    "log": ("log(x_log)", ("positive",), torch.log),
    "abs": ("abs(x_abs)", ("real",), torch.abs),
    "softplus": ("softplus(x_softplus)", ("real",), lambda x: F.softplus(x, threshold=100.0)),
    "gelu": ("gelu(x_gelu)", ("real",), F.gelu),
    "silu": ("silu(x_silu)", ("real",), F.silu),
    "sqrt": ("sqrt(x_sqrt)", ("positive",), torch.sqrt),
    "softmax": ("softmax(x_softmax)", ("real",), lambda x: F.softmax(x, dim=-1)),
    "log_softmax": ("log_softmax(x_log_softmax)", ("real",), lambda x: F.log_softmax(x, dim=-1)),
    # evaluation mode (the default): the identity, saturated inputs too (training: tests/language/test_dropout.py)
    "dropout": ("dropout(x_dropout, 0.5)", ("real",), lambda x: x),
    # ties (the special rows give x == y) split the gradient equally, as torch's
    "minimum": ("minimum(x_minimum, y_minimum)", ("real", "real"), torch.minimum),
    "maximum": ("maximum(x_maximum, y_maximum)", ("real", "real"), torch.maximum),
    "dot": ("dot(x_dot, y_dot)", ("real", "real"), lambda x, y: (x * y).sum(-1, keepdim=True)),
    # within float32's range for the squares (beyond it the variance is inf in float32 and finite in float64:
    # test_layernorm_of_saturated_rows_agrees_with_the_interpreter)
    "layernorm": ("layernorm(x_layernorm)", ("exp",), lambda x: F.layer_norm(x, x.shape[-1:])),
}

#: the shape of an op's state where it is not [H]
STATE_SHAPES = {"dot": (1,)}

#: rows every input of a kind starts with: saturation, large values, 0 and near-0
SPECIAL_ROWS = {
    "real": [
        [100, -100, 30, -30, 0, 1e-3, 8, -8],
        [1e4, -1e4, 15, -15, 0.5, -0.5, 3, -3],
        # whole rows saturated (every lane of a vector loop) and beyond float32 exp's range, up to inf
        [-100] * 8,
        [100] * 8,
        [-89, -88.7, -104, -1e30, 89, 88.8, 104, 1e30],
        [-math.inf] * 4 + [math.inf] * 4,
    ],
    "exp": [[30, -30, 80, -80, 0, 1e-3, 8, -8]],
    "positive": [[100, 1e4, 1e6, 1e-3, 1e-6, 0.5, 30, 2]],
    "divisor": [[1e-2, -1e-2, 100, -100, 1e4, -1e4, 1, -1]],
}


#: what a .cell file can write: the registry's surface names, unary minus and dropout(e, p) (read by the front
#: end itself)
WRITTEN = {op for op, d in OPS.items() if d.surface and d.kind in FUNCTIONAL} | {Op.NEG, Op.DROPOUT}


def test_every_written_op_is_tested():
    assert {Op(name) for name in USER_OPS} == WRITTEN


def _inputs_of(name: str) -> list[str]:
    return [f"{var}_{name}" for var in ("x", "y")[: len(USER_OPS[name][1])]]


ALL_OPS_CELL = f"""
cell AllOps on tree {{
    dim H = {H}
    input {", ".join(f"{i}[H]" for name in USER_OPS for i in _inputs_of(name))}
    state {", ".join(f"s_{name}[{STATE_SHAPES.get(name, ('H',))[0]}]" for name in USER_OPS)}
    node {{
{chr(10).join(f"        s_{name} = {expr}" for name, (expr, _, _) in USER_OPS.items())}
    }}
}}
"""


def _values(kind: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    special = np.asarray(SPECIAL_ROWS[kind], np.float64)
    random = 3 * rng.standard_normal((rows - len(special), H))
    if kind == "positive":
        random = np.abs(random) + 1e-2
    elif kind == "divisor":
        random = np.sign(random) * (0.5 + np.abs(random))
    return np.concatenate([special, random]).astype(np.float32)


@pytest.fixture(scope="module")
def all_ops(tmp_path_factory):
    """The package, a forest, inputs and upstream gradients (fixed seeds), and each device's results."""
    path = tmp_path_factory.mktemp("ops") / "all_ops.cell"
    path.write_text(ALL_OPS_CELL, encoding="utf-8")
    module = cortexc.load(path, out_dir=tmp_path_factory.mktemp("ops_package"))
    rng = np.random.default_rng(9)
    forest = Forest.random(4, rng=rng, max_children=3, max_nodes=8)
    n = forest.num_nodes
    inputs = {}
    for name, (_, kinds, _) in USER_OPS.items():
        for var, kind in zip(_inputs_of(name), kinds):
            inputs[var] = _values(kind, n, rng)
    upstream = {
        f"s_{name}": rng.standard_normal((n, *STATE_SHAPES.get(name, (H,)))).astype(np.float32) for name in USER_OPS
    }
    return module, forest, inputs, upstream, {}


def _run(all_ops, device: str):
    module, forest, inputs, upstream, results = all_ops
    if device not in results:
        model = module.AllOps(device=device)
        out = model(forest, grad=True, **inputs)
        results[device] = (out, model.backward(out, upstream))
    return results[device]


def _torch_reference(name: str, inputs, upstream):
    """The torch function in float64 on the same float32 values, and its gradients for the upstream."""
    _, _, function = USER_OPS[name]
    args = [torch.tensor(inputs[var], dtype=torch.float64, requires_grad=True) for var in _inputs_of(name)]
    y = function(*args)
    grads = torch.autograd.grad(y, args, torch.tensor(upstream[f"s_{name}"], dtype=torch.float64))
    return y.detach().numpy(), [g.numpy() for g in grads]


def _assert_close(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """float32 against float64: 1e-5 relative, and an absolute floor for the values rounding makes 0."""
    assert got.shape == expected.shape, what
    with np.errstate(over="ignore"):
        expected32 = expected.astype(np.float32)  # what float32 can hold: inf where float64 overflows it
    finite = np.isfinite(expected32)  # inf and NaN expected (inf inputs, overflow): the same inf, or NaN
    same = (got == expected32) | (np.isnan(got) & np.isnan(expected32))
    wrong = ~finite & ~same
    assert not wrong.any(), f"{what}: {got[wrong][:4]} where {expected32[wrong][:4]} is expected"
    loose = finite & ~np.isfinite(got)
    assert not loose.any(), f"{what}: not finite at {np.argwhere(loose)[:4].tolist()}"
    got, expected = np.where(finite, got, 0), np.where(finite, expected, 0)
    bad = np.abs(got - expected) > 1e-5 * np.abs(expected) + 2e-6
    assert not bad.any(), f"{what}: {got[bad][:4]} vs {expected[bad][:4]} at {np.argwhere(bad)[:4].tolist()}"


@pytest.mark.parametrize("device", ["interp", "cpu", "cuda-emu"])
@pytest.mark.parametrize("name", sorted(USER_OPS))
def test_op_forward_and_backward_against_torch(all_ops, name, device):
    _, _, inputs, upstream, _ = all_ops
    out, grads = _run(all_ops, device)
    expected, expected_grads = _torch_reference(name, inputs, upstream)
    _assert_close(out[f"s_{name}"], expected, f"{device} {name}")
    for var, expected_grad in zip(_inputs_of(name), expected_grads):
        _assert_close(grads[var], expected_grad, f"{device} d{var}")


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_op_compiles_with_nvcc_without_spills(all_ops):
    """Every op's C text and helper (erff, expf, sqrtf, ...) in device code, sm_80 and sm_90, warnings as errors."""
    (source,) = Path(next(iter(all_ops[0].__path__))).glob("*.cu")
    result = nvcc(source)
    assert result.returncode == 0, result.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert spills and all(s == ("0", "0") for s in spills), "spills registers"


def test_internal_ops_are_reached_by_the_compiled_gradients(all_ops):
    """step, sign and gelu_grad run in the compiled backward above, through relu, abs and gelu."""
    cell = all_ops[0].AllOps.cell
    used = {v.op for body in (cell.grads.leaf, cell.grads.node) for v in body.values}
    assert {Op.STEP, Op.SIGN, Op.GELU_GRAD} <= used


def test_sqrt_of_a_negative_is_nan_and_its_derivative_at_zero_infinite_as_torch():
    cell = autodiff(specialize(lower_source("cell R on tree { input x[2]\n state s[2]\n node { s = sqrt(x) } }")[0]))
    forest = Forest.from_parents([-1])
    x = np.array([[-1.0, 0.0]], np.float32)
    out = reference.run(cell, forest, {}, {"x": x})
    assert np.isnan(out["s"][0, 0]) and out["s"][0, 1] == 0
    with np.errstate(divide="ignore"):  # 1 / (2 * sqrt(0))
        grads = reference.backward(cell, forest, {}, {"x": x}, out, {"s": np.ones((1, 2), np.float32)})
    tx = torch.tensor(x, requires_grad=True)
    (expected,) = torch.autograd.grad(torch.sqrt(tx), tx, torch.ones(1, 2))
    np.testing.assert_array_equal(grads["x"], expected.numpy())  # nan, inf


# --------------------------------------------------------------------------- the ops only passes make

#: op -> (torch reference of its forward, of its derivative), for ops with no surface name
INTERNAL = {
    Op.STEP: (lambda x: (x > 0).double(), lambda x: torch.zeros_like(x)),
    Op.SIGN: (torch.sign, lambda x: torch.zeros_like(x)),
    Op.GELU_GRAD: (None, None),  # from torch's gelu by autograd, below
    Op.RSTD: (lambda x: torch.rsqrt(x + 1e-5), lambda x: -0.5 * torch.rsqrt(x + 1e-5) ** 3),
}


def _gelu_derivatives(x):
    x = x.clone().requires_grad_(True)
    (first,) = torch.autograd.grad(F.gelu(x), x, torch.ones_like(x), create_graph=True)
    (second,) = torch.autograd.grad(first, x, torch.ones_like(x))
    return first.detach(), second


def test_every_internal_op_is_tested():
    functional = {op for op, d in OPS.items() if d.kind in FUNCTIONAL}
    # rowsum (a vector to a scalar) is tested through the gradients of softmax and of broadcast operands
    assert set(INTERNAL) | {Op.EQ, Op.ROWSUM} == functional - WRITTEN


def _cell_with(op: Op, arity: int):
    """A one-state cell whose state is ``op`` of its inputs: written with a stand-in op, then swapped."""
    stand_in = "tanh(x)" if arity == 1 else "x * y"
    source = f"cell C on tree {{ input x[{H}], y[{H}]\n state s[{H}]\n node {{ s = {stand_in} }} }}"
    cell = lower_source(source)[0]
    values = tuple(replace(v, op=op) if v.op in (Op.TANH, Op.MUL) else v for v in cell.node.values)
    return autodiff(specialize(replace(cell, node=replace(cell.node, values=values))))


@pytest.mark.parametrize("op", [*INTERNAL, Op.EQ], ids=lambda op: op.value)
def test_internal_op_rule_and_derivative_against_torch(op, rng):
    arity = OPS[op].arity
    cell = _cell_with(op, arity)
    forest = Forest.from_parents([-1] * 12)
    x = np.concatenate([np.asarray(SPECIAL_ROWS["real"]), 3 * rng.standard_normal((12 - len(SPECIAL_ROWS["real"]), H))])
    y = np.where(rng.random((12, H)) < 0.5, x, rng.standard_normal((12, H)))  # eq: half the entries equal
    inputs = {"x": x, "y": y}
    out = reference.run(cell, forest, {}, inputs, dtype=np.float64)
    upstream = {"s": rng.standard_normal((12, H))}
    grads = reference.backward(cell, forest, {}, inputs, out, upstream, dtype=np.float64)
    tx, ty, tg = (torch.tensor(a) for a in (x, y, upstream["s"]))
    if op == Op.GELU_GRAD:
        value, derivative = _gelu_derivatives(tx)
    elif op == Op.EQ:
        value, derivative = (tx == ty).double(), torch.zeros_like(tx)
    else:
        value, derivative = INTERNAL[op][0](tx), INTERNAL[op][1](tx)
    np.testing.assert_allclose(out["s"], value.numpy(), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(grads["x"], (tg * derivative).numpy(), rtol=1e-10, atol=1e-300)
    if arity == 2:
        np.testing.assert_array_equal(grads["y"], 0.0)


def test_gelu_grad_is_torch_gelu_derivative_in_float32(rng):
    special = np.asarray(SPECIAL_ROWS["real"]).ravel()
    x = np.concatenate([special[np.isfinite(special)], 4 * rng.standard_normal(64)]).astype(np.float32)
    first, _ = _gelu_derivatives(torch.tensor(x, dtype=torch.float64))
    with np.errstate(over="ignore"):  # x * x overflows float32 at 1e30: the derivative is 0 (or 1) there anyway
        got = OPS[Op.GELU_GRAD].numpy(x).astype(np.float32)
    assert np.abs(got - first.numpy()).max() < 1e-6 * math.sqrt(len(x))


#: the unary ops a .cell file writes, each composed into a product and a sum: fast-math may rewrite
#: `1 / (1 + e) * t` as a (vectorised, approximate) division of t, where e = inf at saturation made NaN
COMPOSED = sorted(name for name in USER_OPS if OPS[Op(name)].kind == OpKind.UNARY)
COMPOSED_CELL = f"""
cell Composed on tree {{
    dim H = {H}
    input x[H], y[H]
    state {", ".join(f"p_{name}[H], q_{name}[H]" for name in COMPOSED)}
    node {{
        t = tanh(softplus(y))
{chr(10).join(f"        p_{name} = {USER_OPS[name][0].replace(f'x_{name}', 'x')} * t" for name in COMPOSED)}
{chr(10).join(f"        q_{name} = y - {USER_OPS[name][0].replace(f'x_{name}', 'x')} / (2 + t)" for name in COMPOSED)}
    }}
}}
"""


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    path = tmp_path_factory.mktemp("composed") / "composed.cell"
    path.write_text(COMPOSED_CELL, encoding="utf-8")
    module = cortexc.load(path, out_dir=tmp_path_factory.mktemp("composed_package"))
    rng = np.random.default_rng(5)
    forest = Forest.random(4, rng=rng, max_children=3, max_nodes=8)
    x = _values("real", forest.num_nodes, rng)
    y = np.full_like(x, 0.5)
    upstream = {s.name: rng.standard_normal(x.shape).astype(np.float32) for s in module.Composed.signature.states}
    reference_model = module.Composed(device="interp")
    out = reference_model(forest, grad=True, x=x, y=y)
    return module, forest, {"x": x, "y": y}, upstream, (out, reference_model.backward(out, upstream))


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
def test_saturated_inputs_through_composed_ops_match_the_interpreter(composed, device):
    """x = +-100, +-1e30, +-inf in every lane: what the interpreter gives, inf and NaN included."""
    module, forest, inputs, upstream, (expected, expected_grads) = composed
    model = module.Composed(device=device)
    out = model(forest, grad=True, **inputs)
    grads = model.backward(out, upstream)
    for name, value in expected.items():
        _assert_close(out[name], value.astype(np.float64), f"{device} {name}")
    for name, value in expected_grads.items():
        _assert_close(grads[name], value.astype(np.float64), f"{device} d{name}")


@pytest.mark.parametrize("name", COMPOSED)
def test_a_saturated_op_alone_in_its_loop_matches_the_interpreter(name, tmp_path):
    """The op in a loop of its own, which gcc vectorises (libmvec, approximate reciprocals): x = -100 gave
    NaN for sigmoid where the interpreter gives 0."""
    expression = USER_OPS[name][0].replace(f"x_{name}", "x")
    path = tmp_path / "alone.cell"
    path.write_text(
        f"cell M on tree {{ dim H = {H} input x[H], y[H] state h[H] node {{ h = {expression} * tanh(softplus(y)) }} }}",
        encoding="utf-8",
    )
    module = cortexc.load(path, out_dir=tmp_path / "out")
    forest = Forest.from_parents([-1, 0, 0, 1, -1, 4, 4, -1])
    x = np.asarray(SPECIAL_ROWS["real"] + [[-100] * H, [-1e30] * H], np.float32)
    y = np.full_like(x, 0.5)
    upstream = {"h": np.linspace(-1, 1, x.size, dtype=np.float32).reshape(x.shape)}
    interp, compiled = module.M(device="interp"), module.M(device="cpu")
    out_i, out_c = interp(forest, grad=True, x=x, y=y), compiled(forest, grad=True, x=x, y=y)
    _assert_close(out_c["h"], out_i["h"].astype(np.float64), f"cpu {name}")
    grads_i, grads_c = interp.backward(out_i, upstream), compiled.backward(out_c, upstream)
    for var in ("x", "y"):
        _assert_close(grads_c[var], grads_i[var].astype(np.float64), f"cpu d{var} of {name}")


def test_layernorm_of_saturated_rows_agrees_with_the_interpreter(tmp_path):
    """Rows of +-100, +-1e30 (whose squares overflow float32: the variance is inf and the result 0) and inf:
    the compiled kernels give the interpreter's float32 results, forward and backward."""
    path = tmp_path / "ln.cell"
    path.write_text(
        f"cell LN on tree {{ dim H = {H}\n input x[H]\n state s[H]\n node {{ s = layernorm(x + sum(child.s)) }} }}"
    )
    module = cortexc.load(path, out_dir=tmp_path / "out")
    forest = Forest.from_parents([-1] * 6)
    x = np.asarray(SPECIAL_ROWS["real"], np.float32)
    upstream = {"s": np.random.default_rng(3).standard_normal((6, H)).astype(np.float32)}
    results = {}
    for device in ("interp", "cpu", "cuda-emu"):
        model = module.LN(device=device)
        out = model(forest, grad=True, x=x)
        results[device] = (out["s"], model.backward(out, upstream)["x"])
    for device in ("cpu", "cuda-emu"):
        for got, expected in zip(results[device], results["interp"]):
            same = np.isclose(got, expected, rtol=1e-5, atol=2e-6) | (np.isnan(got) & np.isnan(expected))
            assert same.all(), (device, got[~same][:4], expected[~same][:4])
