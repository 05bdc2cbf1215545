"""Attention over children (language v2): `child_softmax`, `[1]` broadcasting and `v[k]` subscripts.

The attentive Tree-LSTM (examples/attn_treelstm.cell), an arity cell with missing children and a DAG cell
run on every device (interpreter, C, emulated CUDA) against a per-node PyTorch model written here (float64
autograd: forward and gradients), on random forests and SST trees; saturated scores (±100, ±inf) against
the interpreter; the misuses are located errors. Finite differences of the same cells are in
test_autodiff.py (INVENTED, EXAMPLE_CASES), their nvcc builds in test_invented_cells.py / test_cuda_target.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest, reference
from cortexc.errors import CellError, CellTypeError
from cortexc.frontend import lower_source
from cortexc.ir.ops import Op
from tests.helpers import EXAMPLES, random_inputs, relative_error, sst_path
from tests.ir.test_autodiff import INVENTED

torch = pytest.importorskip("torch")

DEVICES = ["interp", "cpu", "cuda-emu"]
#: the same, the compiled ones marked slow (their dims make the packages' builds and runs long)
COMPILED_SLOW = ["interp", *(pytest.param(d, marks=pytest.mark.slow) for d in ("cpu", "cuda-emu"))]
RTOL = 1e-5


# ----------------------------------------------------------------------------- per-node torch models


def _stack(rows):
    return torch.stack(rows) if rows else None


def torch_attn_treelstm(P, x, forest):
    """The attentive Tree-LSTM node by node: scores w_a tanh(W_a h_k), softmax over the children."""
    H = P["U_f"].shape[0]
    h, c = {}, {}
    for n in forest.level_order.tolist():
        kids = forest.children(n).tolist()
        wx_f = P["W_f"] @ x[n] + P["b_f"]
        if kids:
            ch, cc = _stack([h[k] for k in kids]), _stack([c[k] for k in kids])
            scores = torch.tanh(ch @ P["W_a"].T) @ P["w_a"].T  # [m, 1]
            a = torch.softmax(scores, dim=0)
            h_att = (a * ch).sum(0)
            fc = (torch.sigmoid(ch @ P["U_f"].T + wx_f) * cc).sum(0)
        else:
            h_att = fc = torch.zeros(H, dtype=x.dtype)
        iou = P["W_iou"] @ x[n] + P["U_iou"] @ h_att + P["b_iou"]
        c[n] = torch.sigmoid(iou[:H]) * torch.tanh(iou[2 * H :]) + fc
        h[n] = torch.sigmoid(iou[H : 2 * H]) * torch.tanh(c[n])
    order = range(forest.num_nodes)
    return {"h": torch.stack([h[n] for n in order]), "c": torch.stack([c[n] for n in order])}


def torch_attn_arity(P, x, forest):
    """INVENTED["child_softmax_arity"]: softmax over the existing children; child[k] missing is 0."""
    H = P["U"].shape[0]
    h, c = {}, {}
    zero = torch.zeros(H, dtype=x.dtype)
    for n in forest.level_order.tolist():
        kids = forest.children(n).tolist()
        wx = P["W"] @ x[n]
        if kids:
            ch, cc = _stack([h[k] for k in kids]), _stack([c[k] for k in kids])
            a = torch.softmax(ch @ P["w_a"].T + P["w_a"] @ wx, dim=0)
            att_c, att_h = (a * cc).sum(0), (a * ch).sum(0)
        else:
            att_c = att_h = zero
        h2 = h[kids[2]] if len(kids) > 2 else zero
        c1 = c[kids[1]] if len(kids) > 1 else zero
        h[n] = torch.tanh(wx + att_c + P["U"] @ h2 + P["b"])
        c[n] = att_h + c1
    order = range(forest.num_nodes)
    return {"h": torch.stack([h[n] for n in order]), "c": torch.stack([c[n] for n in order])}


def torch_attn_dag(P, x, forest):
    """INVENTED["child_softmax_dag"]: each parent normalises over its own children, shared or not."""
    H = P["U"].shape[0]
    h = {}
    for n in forest.level_order.tolist():
        kids = forest.children(n).tolist()
        if kids:
            ch = _stack([h[k] for k in kids])
            a = torch.softmax(torch.tanh(ch @ P["U"].T) @ P["w_a"].T, dim=0)
            att = (a * ch).sum(0)
        else:
            att = torch.zeros(H, dtype=x.dtype)
        h[n] = torch.tanh(P["W"] @ x[n] + P["U"] @ att + P["b"])
    return {"h": torch.stack([h[n] for n in range(forest.num_nodes)])}


def torch_reference(fn, params, inputs, forest, upstream):
    """Forward and gradients (of sum <upstream, out>) of a per-node torch model, in float64."""
    P = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    x = torch.tensor(inputs["x"], dtype=torch.float64, requires_grad=True)
    out = fn(P, x, forest)
    loss = sum((out[k] * torch.tensor(upstream[k], dtype=torch.float64)).sum() for k in out)
    loss.backward()
    grads = {k: p.grad.numpy() for k, p in P.items()}
    grads["x"] = x.grad.numpy()
    return {k: v.detach().numpy() for k, v in out.items()}, grads


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """The example at small dims (and its SST dims) and the arity and DAG cells of test_autodiff."""
    out = tmp_path_factory.mktemp("attn")
    cells = {}
    for name in ("child_softmax_arity", "child_softmax_dag"):
        path = out / f"{name}.cell"
        path.write_text(INVENTED[name][1], encoding="utf-8")
        cells[name] = cortexc.load(path, out_dir=out / f"pkg_{name}").__dict__
    cells["small"] = cortexc.load(EXAMPLES / "attn_treelstm.cell", out_dir=out / "small", X=6, H=5).__dict__
    return cells


def _models(module, cls_name, device, rng, jitter=0.3):
    cls = module[cls_name]
    model, base = cls(device=device, seed=5), cls(device="interp", seed=5)
    params = {k: (v + jitter * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.params.items()}
    model.load_params(params)
    return model, params


def _check_against_torch(model, params, forest, fn, rng, what):
    inputs = random_inputs(model.cell, forest, rng)
    out = model(forest, grad=True, **inputs)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items()}
    expected, expected_grads = torch_reference(fn, params, inputs, forest, upstream)
    for k, v in expected.items():
        assert relative_error(out[k], v) < RTOL, f"{what}: {k}"
    grads = model.backward(out, upstream)
    assert set(grads) == set(expected_grads)
    for k, v in expected_grads.items():
        assert relative_error(grads[k], v) < RTOL, f"{what}: d{k} {relative_error(grads[k], v):.2e}"
    return out


@pytest.mark.parametrize("device", COMPILED_SLOW)
def test_attentive_treelstm_matches_per_node_torch_on_random_forests(packages, device, rng):
    model, params = _models(packages["small"], "AttnTreeLSTM", device, rng)
    forest = Forest.concat(
        [
            Forest.random(6, rng=rng, max_children=5, max_nodes=14),
            Forest.from_parents([-1]),  # a lone leaf: no children, attention sums to 0
            Forest.from_parents([1, 2, -1]),  # a chain: one child, weight exactly 1
        ]
    )
    _check_against_torch(model, params, forest, torch_attn_treelstm, rng, f"AttnTreeLSTM {device}")


@pytest.mark.parametrize("device", ["interp", "cpu", pytest.param("cuda-emu", marks=pytest.mark.slow)])
def test_arity_cell_leaves_missing_children_out_of_the_softmax(packages, device, rng):
    model, params = _models(packages["child_softmax_arity"], "AttnArity", device, rng)
    forest = Forest.concat(
        [Forest.random(6, rng=rng, max_children=3, max_nodes=14), Forest.from_parents([3, 3, 3, -1])]
    )
    counts = {len(forest.children(n)) for n in range(forest.num_nodes)}
    assert {1, 3} <= counts or {2, 3} <= counts, counts  # some nodes miss children, some have them all
    _check_against_torch(model, params, forest, torch_attn_arity, rng, f"AttnArity {device}")


@pytest.mark.parametrize("device", COMPILED_SLOW)
def test_dag_cell_normalises_per_parent_over_shared_children(packages, device, rng):
    model, params = _models(packages["child_softmax_dag"], "AttnDag", device, rng)
    while True:
        forest = Forest.random_dag(30, rng, max_children=4, max_parents=3)
        kids = np.concatenate([forest.children(i) for i in range(30)])
        if np.bincount(kids, minlength=30).max() >= 2:
            break  # some node has several parents
    _check_against_torch(model, params, forest, torch_attn_dag, rng, f"AttnDag {device}")


def test_attention_weights_sum_to_one_over_the_children(rng):
    """The weights of a node's children sum to 1 (the old silent softmax over one element gave each child 1,
    so two children summed to 2); a node without children has none, so their sum is 0."""
    source = INVENTED["child_softmax_dag"][1].replace(
        "h = tanh(W @ x + U @ sum(a * child.h) + b)", "h = sum(a) + 0 * x"
    )
    cell = lower_source(source, "w.cell")[0]
    forest = Forest.from_parents([2, 2, -1])
    params = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in cell.params}
    x = rng.standard_normal((3, 4)).astype(np.float32)
    out = reference.run(cell, forest, params, {"x": x})
    np.testing.assert_allclose(out["h"][2], np.ones(4), rtol=1e-6)  # the weights of the root sum to 1
    np.testing.assert_allclose(out["h"][:2], 0.0)  # leaves: no children, the sum is 0


# ----------------------------------------------------------------------------- SST trees


@pytest.fixture(scope="module")
def sst_forest():
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    return Forest.from_ptb(lines[:40])


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_attentive_treelstm_on_sst_trees_at_its_own_dims(sst_forest, device, rng, tmp_path_factory):
    """X = 300, H = 150 as declared, on 40 SST dev trees: forward and gradients against per-node torch."""
    module = cortexc.load(EXAMPLES / "attn_treelstm.cell", out_dir=tmp_path_factory.mktemp("sst")).__dict__
    model, params = _models(module, "AttnTreeLSTM", device, rng, jitter=0.02)
    assert dict(model.cell.dims) == {"X": 300, "H": 150}
    out = _check_against_torch(model, params, sst_forest, torch_attn_treelstm, rng, f"SST {device}")
    assert out["h"].shape == (sst_forest.num_nodes, 150)


# ----------------------------------------------------------------------------- saturated scores

SATURATED = """
cell Saturated on tree {
    dim H = 3
    input x[H], s[1]
    state h[H], z[1]
    node {
        a = child_softmax(child.z)          # the children's raw scores
        q = child_softmax(child.h)          # component-wise, on the children's raw states
        h = x + sum(a * child.h) + sum(q * child.h)
        z = s
    }
}
"""


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
@pytest.mark.parametrize("scores", ["100", "inf"])
def test_saturated_scores_agree_with_the_interpreter(device, scores, rng, tmp_path_factory):
    """Scores of ±100 (max subtraction keeps them finite) and -inf (a child masked out: weight 0; +inf
    among finite scores gives NaN, as in torch) for forward and backward, NaN where the interpreter has it."""
    path = tmp_path_factory.mktemp("sat") / "saturated.cell"
    path.write_text(SATURATED, encoding="utf-8")
    module = cortexc.load(path, out_dir=path.parent / "pkg")
    model, interp = module.Saturated(device=device), module.Saturated(device="interp")
    forest = Forest.concat(
        [Forest.random(8, rng=rng, max_children=4, max_nodes=12), Forest.from_parents([3, 3, 3, -1])]
    )
    n = forest.num_nodes
    if scores == "100":
        s = rng.choice([-100.0, 100.0, 99.5, 0.0], (n, 1))
        x = rng.choice([-100.0, 100.0, 1.0], (n, 3))
    else:
        s = rng.choice([-np.inf, 0.0, 1.0, -np.inf], (n, 1))
        s[forest.children(n - 1)] = [[-np.inf], [2.0], [np.inf]]  # the last root: one +inf, one -inf child
        x = rng.standard_normal((n, 3))
    inputs = {"x": x.astype(np.float32), "s": s.astype(np.float32)}
    out, expected = model(forest, grad=True, **inputs), interp(forest, grad=True, **inputs)
    for k in expected:
        atol = _term_scaled(expected[k], 1e-5, RTOL)
        np.testing.assert_allclose(out[k], expected[k], rtol=RTOL, atol=atol, equal_nan=True, err_msg=k)
    if scores == "inf":
        assert np.isnan(expected["h"][n - 1]).all()  # +inf among finite scores: NaN, as torch.softmax
        finite = ~np.isnan(expected["h"]).any(axis=1)
        assert finite.sum() > n // 2  # -inf alone only masks its child
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
    grads, expected_grads = model.backward(out, upstream), interp.backward(expected, upstream)
    for k in expected_grads:
        atol = _term_scaled(expected_grads[k], 1e-4, 1e-4)
        np.testing.assert_allclose(grads[k], expected_grads[k], rtol=RTOL, atol=atol, equal_nan=True, err_msg=k)


def _term_scaled(expected: np.ndarray, floor: float, relative: float) -> float:
    """An absolute tolerance in proportion to the array's largest finite value. With scores and states of
    ±100 a small result is often the difference of terms of hundreds (x = -100 plus children's +100), so
    float32 rounding of those terms, in any summation order, leaves ~1e-5 of it; elementwise tolerances
    failed ~1.4% of seeds (2.3e-5 on a forward h of 1, 4e-4 on a gradient of 6). Measured over 3000 seeds:
    the error is at most 1.4e-7 (forward) and 1.6e-5 (backward) of the array's largest value."""
    finite = np.abs(expected[np.isfinite(expected)])
    return max(floor, relative * float(finite.max())) if finite.size else floor


# ----------------------------------------------------------------------------- the language


def _node(body: str, *after: str, decls: str = "", arity: str = "") -> str:
    """A cell whose node block is line 7; the body starts at column 12."""
    return "\n".join(
        [
            f"cell C on tree{arity} {{",
            "    dim X = 4, H = 8",
            "    input x[X], w : index[4]",
            "    param W[H, X], U[H, H], w_a[1, H], b[H], E[4, H]",
            "    state h[H]",
            f"    {decls}",
            f"    node {{ {body} }}",
            *after,
            "}",
            "",
        ]
    )


def _error(source: str) -> CellError:
    with pytest.raises(CellError) as info:
        lower_source(source, "t.cell")
    return info.value


ERRORS = [
    # (id, source, line, col, fragment)
    (
        "child-softmax-of-a-per-node-value",
        _node("h = sum(child_softmax(W @ x) * child.h)"),
        7,
        20,
        "child_softmax takes a per-child value (one per child, e.g. w_a @ child.h), but W @ x is the same",
    ),
    (
        "child-softmax-in-a-leaf",
        _node("h = b", decls="leaf { h = child_softmax(b) }"),
        6,
        16,
        "child_softmax(...) in a leaf block: leaves have no children",
    ),
    (
        "child-softmax-in-an-output",
        _node("h = b", "    output o[1] = child_softmax(w_a @ h)"),
        8,
        19,
        "child_softmax(...) in an output: outputs are computed from the node alone",
    ),
    (
        "child-softmax-without-arguments",
        _node("h = sum(child_softmax() * child.h)"),
        7,
        20,
        "child_softmax takes one argument (a per-child value), got 0",
    ),
    (
        "child-softmax-of-two-arguments",
        _node("h = sum(child_softmax(w_a @ child.h, b) * child.h)"),
        7,
        20,
        "child_softmax takes one argument (a per-child value), got 2",
    ),
    (
        "child-softmax-into-a-state",
        _node("h = child_softmax(U @ child.h)"),
        7,
        16,
        "state 'h' is assigned a per-child value: reduce it over the children with sum(...), mean(...) or max(...)",
    ),
    (
        "softmax-of-a-per-child-score",  # the old silent case: every weight 1
        _node("h = sum(softmax(w_a @ child.h) * child.h)"),
        7,
        20,
        "softmax of w_a @ child.h, a [1] value, is always 1 (a softmax over one element); "
        "to normalise per-child scores across the children, use child_softmax(w_a @ child.h)",
    ),
    (
        "log-softmax-of-a-per-node-1",
        _node("h = b * log_softmax(w_a @ b)"),
        7,
        20,
        "log_softmax of w_a @ b, a [1] value, is always 0",
    ),
    ("subscript-out-of-range", _node("h = b * b[H]"), 7, 22, "b[H]: subscript 8 is out of range for b[8]"),
    ("subscript-negative", _node("h = b * b[0 - 1]"), 7, 22, "subscript -1 is out of range for b[8]"),
    (
        "subscript-by-a-local",
        _node("k = b; h = b * b[k]"),
        7,
        29,
        "a subscript must be a constant made of numbers and dims, but 'k' is a local",
    ),
    (
        "subscript-by-an-input",
        _node("h = b * b[x]"),
        7,
        22,
        "a subscript must be a constant made of numbers and dims, but 'x' is an input",
    ),
    ("subscript-not-an-integer", _node("h = b * b[1 / 2]"), 7, 22, "a subscript must be an integer, but this is 0.5"),
]


@pytest.mark.parametrize(("source", "line", "col", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_misuse_is_a_located_error(source, line, col, fragment):
    err = _error(source)
    shown = err.format()
    assert type(err) is CellTypeError, shown
    assert err.loc is not None and err.loc.file == "t.cell", shown
    assert (err.loc.line, err.loc.col) == (line, col), shown
    assert fragment in err.message, shown
    assert "^" in shown.splitlines()[-1], shown  # the caret under the place


def test_a_constant_subscript_is_a_one_element_slice():
    """`v[k]` (k a constant expression of dims) lowers to exactly the value of `v[k:k+1]`."""
    subscript = lower_source(_node("h = b * b[H - 1] + b[2] * (W @ x)"), "t.cell")[0]
    sliced = lower_source(_node("h = b * b[H - 1:H] + b[2:3] * (W @ x)"), "t.cell")[0]
    assert [(v.op, v.args, v.shape, v.attrs) for v in subscript.node.values] == [
        (v.op, v.args, v.shape, v.attrs) for v in sliced.node.values
    ]
    slices = [v for v in subscript.node.values if v.op == Op.SLICE]
    assert {v.attrs for v in slices} == {(("lo", 7), ("hi", 8)), (("lo", 2), ("hi", 3))}
    assert all(v.shape == (1,) for v in slices)


def test_one_element_vectors_broadcast_like_scalars_in_every_elementwise_op():
    """[1] against [H], per node and per child, on either side of + - * /, and [1] with [1] stays [1]."""
    cell = lower_source(
        _node("s = w_a @ child.h; t = w_a @ b; h = sum(s * child.h - t / (1 + s * s)) + (b - t) / (t * t + 1)"),
        "t.cell",
    )[0]
    shapes = {(v.op, v.shape) for v in cell.node.values if v.op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV)}
    assert (Op.MUL, (8,)) in shapes and (Op.DIV, (8,)) in shapes and (Op.MUL, (1,)) in shapes
    with pytest.raises(CellError, match="shape mismatch"):
        lower_source(_node("v = U @ b; h = b * v[0:2]"), "t.cell")  # [2] does not broadcast
