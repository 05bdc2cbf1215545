"""Models written gate by gate, as the papers write them: each gate a sum ``W_g @ x + U_g @ h + b_g`` over the
same vectors. The direct node kernel (`passes.direct`) stacks each such sum's params side by side, and
`BodyBuilder` makes the gates' equal operands ``concat(x, h)`` one value, so the sums share one GEMM whose
packed weight is a block matrix (`PackedWeight.blocks`). Here: the programs have that shape on both sides of
`Target.direct_max_k`, every cell's inference (direct and hoisted kernels forced) matches the interpreter on
cpu, and the gate-by-gate LSTM matches `torch.nn.LSTM` with the same weights. test_invented_cells runs the
same cells' training forward and backward on cpu and cuda-emu, and nvcc."""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.codegen.target import TARGETS
from cortexc.ir.program import KernelRole
from cortexc.options import CompileOptions
from cortexc.pipeline import Source, run_stages
from tests.helpers import chains, random_inputs, relative_error, twin_models

#: the LSTM (Hochreiter & Schmidhuber; torch.nn.LSTM's gate order i, f, g, o)
LSTM = """
cell GateLSTM on tree(arity = 1) {
    dim X = 8, H = 8
    input x[X]
    param W_i[H, X], W_f[H, X], W_g[H, X], W_o[H, X]
    param U_i[H, H], U_f[H, H], U_g[H, H], U_o[H, H]
    param b_i[H], b_f[H], b_g[H], b_o[H]
    state h[H], c[H]
    node {
        i = sigmoid(W_i @ x + U_i @ child[0].h + b_i)
        f = sigmoid(W_f @ x + U_f @ child[0].h + b_f)
        g = tanh(W_g @ x + U_g @ child[0].h + b_g)
        o = sigmoid(W_o @ x + U_o @ child[0].h + b_o)
        c = f * child[0].c + i * g
        h = o * tanh(c)
    }
}
"""

#: Cho et al. (2014)'s GRU: the candidate reads the reset hidden state
GRU = """
cell GateGRU on tree(arity = 1) {
    dim X = 8, H = 8
    input x[X]
    param W_z[H, X], W_r[H, X], W_n[H, X], U_z[H, H], U_r[H, H], U_n[H, H], b_z[H], b_r[H], b_n[H]
    state h[H]
    node {
        z = sigmoid(W_z @ x + U_z @ child[0].h + b_z)
        r = sigmoid(W_r @ x + U_r @ child[0].h + b_r)
        n = tanh(W_n @ x + U_n @ (r * child[0].h) + b_n)
        h = (1 - z) * n + z * child[0].h
    }
}
"""

#: Tai et al. (2015)'s Child-Sum Tree-LSTM, a gate at a time
CHILD_SUM = """
cell GateChildSum on tree {
    dim X = 8, H = 8
    input x[X]
    param W_i[H, X], W_o[H, X], W_u[H, X], W_f[H, X], U_i[H, H], U_o[H, H], U_u[H, H], U_f[H, H]
    param b_i[H], b_o[H], b_u[H], b_f[H]
    state h[H], c[H]
    node {
        s = sum(child.h)
        i = sigmoid(W_i @ x + U_i @ s + b_i)
        o = sigmoid(W_o @ x + U_o @ s + b_o)
        u = tanh(W_u @ x + U_u @ s + b_u)
        f = sigmoid(W_f @ x + U_f @ child.h + b_f)
        c = i * u + sum(f * child.c)
        h = o * tanh(c)
    }
}
"""

#: Tai et al.'s N-ary Tree-LSTM (N = 2): a forget gate per child, `W_f @ x` shared by both (a repeated product)
NARY = """
cell GateNary on tree(arity = 2) {
    dim X = 8, H = 8
    input x[X]
    param W_i[H, X], W_o[H, X], W_u[H, X], W_f[H, X]
    param U_i0[H, H], U_i1[H, H], U_o0[H, H], U_o1[H, H], U_u0[H, H], U_u1[H, H]
    param U_f00[H, H], U_f01[H, H], U_f10[H, H], U_f11[H, H]
    param b_i[H], b_o[H], b_u[H], b_f[H]
    state h[H], c[H]
    node {
        i = sigmoid(W_i @ x + U_i0 @ child[0].h + U_i1 @ child[1].h + b_i)
        o = sigmoid(W_o @ x + U_o0 @ child[0].h + U_o1 @ child[1].h + b_o)
        u = tanh(W_u @ x + U_u0 @ child[0].h + U_u1 @ child[1].h + b_u)
        f0 = sigmoid(W_f @ x + U_f00 @ child[0].h + U_f01 @ child[1].h + b_f)
        f1 = sigmoid(W_f @ x + U_f10 @ child[0].h + U_f11 @ child[1].h + b_f)
        c = i * u + f0 * child[0].c + f1 * child[1].c
        h = o * tanh(c)
    }
}
"""

#: a binary Tree-GRU: a reset gate per child, the update gate mixing the children's mean and the candidate
TREE_GRU = """
cell GateTreeGRU on tree(arity = 2) {
    dim X = 8, H = 8
    input x[X]
    param W_z[H, X], W_r0[H, X], W_r1[H, X], W_n[H, X]
    param U_z0[H, H], U_z1[H, H], U_r00[H, H], U_r01[H, H], U_r10[H, H], U_r11[H, H], U_n0[H, H], U_n1[H, H]
    param b_z[H], b_r0[H], b_r1[H], b_n[H]
    state h[H]
    node {
        l = child[0].h
        r = child[1].h
        z = sigmoid(W_z @ x + U_z0 @ l + U_z1 @ r + b_z)
        r0 = sigmoid(W_r0 @ x + U_r00 @ l + U_r01 @ r + b_r0)
        r1 = sigmoid(W_r1 @ x + U_r10 @ l + U_r11 @ r + b_r1)
        n = tanh(W_n @ x + U_n0 @ (r0 * l) + U_n1 @ (r1 * r) + b_n)
        h = z * (0.5 * (l + r)) + (1 - z) * n
    }
}
"""

#: Gers & Schmidhuber's peephole LSTM: the gates also see the cell state (diagonal peepholes)
PEEPHOLE = """
cell GatePeephole on tree(arity = 1) {
    dim X = 8, H = 8
    input x[X]
    param W_i[H, X], W_f[H, X], W_g[H, X], W_o[H, X], U_i[H, H], U_f[H, H], U_g[H, H], U_o[H, H]
    param p_i[H], p_f[H], p_o[H], b_i[H], b_f[H], b_g[H], b_o[H]
    state h[H], c[H]
    node {
        i = sigmoid(W_i @ x + U_i @ child[0].h + p_i * child[0].c + b_i)
        f = sigmoid(W_f @ x + U_f @ child[0].h + p_f * child[0].c + b_f)
        g = tanh(W_g @ x + U_g @ child[0].h + b_g)
        c = f * child[0].c + i * g
        o = sigmoid(W_o @ x + U_o @ child[0].h + p_o * c + b_o)
        h = o * tanh(c)
    }
}
"""

#: a highway Tree-LSTM: a carry gate between the Child-Sum Tree-LSTM's output and a projection of the input;
#: one gate written over an explicit ``concat(x, s)`` equal to the direct kernel's operand
HIGHWAY = """
cell GateHighway on tree {
    dim X = 8, H = 8
    input x[X]
    param W_i[H, X], W_o[H, X], W_u[H, X], W_f[H, X], U_i[H, H], U_o[H, H], U_u[H, H], U_f[H, H]
    param W_t[H, X + H], W_p[H, X], b_i[H], b_o[H], b_u[H], b_f[H], b_t[H]
    state h[H], c[H]
    node {
        s = sum(child.h)
        i = sigmoid(W_i @ x + U_i @ s + b_i)
        o = sigmoid(W_o @ x + U_o @ s + b_o)
        u = tanh(W_u @ x + U_u @ s + b_u)
        f = sigmoid(W_f @ x + U_f @ child.h + b_f)
        c = i * u + sum(f * child.c)
        t = sigmoid(W_t @ concat(x, s) + b_t)
        h = t * o * tanh(c) + (1 - t) * (W_p @ x)
    }
}
"""

#: stem -> cell text (dims X = H = 8: K = 16, stacked)
CELLS = {
    "gate_lstm": LSTM,
    "gate_gru": GRU,
    "gate_child_sum": CHILD_SUM,
    "gate_nary": NARY,
    "gate_tree_gru": TREE_GRU,
    "gate_peephole": PEEPHOLE,
    "gate_highway": HIGHWAY,
}


def gate_forest(text: str, rng: np.random.Generator) -> Forest:
    """Wide levels (the direct kernel's), with some of one row: chains, binary or any-arity trees."""
    if "arity = 1" in text:
        return chains(40, *(int(n) for n in rng.integers(2, 30, 40)))
    if "arity = 2" in text:
        return Forest.random(60, rng=rng, binary=True, max_children=2, max_nodes=25)
    return Forest.concat([Forest.random(60, rng=rng, max_nodes=25), chains(9)])


def _c_program(text: str, dims: dict[str, int]):
    options = CompileOptions.make(dims, targets=("c",))
    ((variant,),) = run_stages(Source(text, "<gate>.cell"), options, until="target")
    return variant.program


def k_dims(stem: str, k: int) -> dict[str, int]:
    """Dims at which the cell's gate sums stack K = `k` columns: X + H, or X + 2H with two children read."""
    h = 64 if "arity = 2" in CELLS[stem] else 128
    return {"X": k - 128, "H": h}


#: stacked widths on both sides of Target.direct_max_k (256): stacked where K is at most that
WIDTHS = [(16, True), (256, True), (257, False)]


@pytest.mark.parametrize("k, stacked", WIDTHS, ids=[f"K{k}" for k, _ in WIDTHS])
@pytest.mark.parametrize("stem", sorted(CELLS))
def test_gate_sums_over_the_same_vectors_share_one_block_weight(stem, k, stacked):
    """Each gate's sum is a block row of one packed weight over one operand, the direct kernel's single
    GEMM (K at most 256); wider, no direct kernel."""
    assert TARGETS["c"].direct_max_k == 256
    program = _c_program(CELLS[stem], {"X": 8, "H": 8} if k == 16 else k_dims(stem, k))
    direct = [k for k in program.kernels if k.role == KernelRole.NODE_DIRECT]
    assert bool(direct) == stacked
    if stacked:
        (kernel,) = direct
        packed = {w.name: w for w in program.packed}
        gemms = [s for s in kernel.steps if type(s).__name__ == "Gemm"]
        blocked = [packed[g.packed] for g in gemms if len(packed[g.packed].blocks) > 1]
        assert blocked, "the gates' sums should make one GEMM of several block rows"
        for weight in blocked:
            rows = weight.block_rows()
            assert weight.m == sum(program.cell.param(row[0][0]).shape[0] for row in rows)
            assert all(sum(program.cell.param(p).shape[1] for p, _ in row) == weight.k for row in rows)


def _load(stem: str, root, **dims: int):
    path = root / f"{stem}.cell"
    path.write_text(CELLS[stem], encoding="utf-8")
    return cortexc.load(path, out_dir=root / "packages", **dims)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("gates")
    return {stem: _load(stem, root) for stem in CELLS}


def _run(model, forest, direct: int, **inputs):
    executor = model._executor_for_device()
    executor.direct = direct
    try:
        return model(forest, **inputs)
    finally:
        executor.direct = 0


def _check_inference(module, rng: np.random.Generator, text: str, stacked: bool = True) -> None:
    model, reference = twin_models(module, "cpu", int(rng.integers(0, 2**31)), rng)
    forest = gate_forest(text, rng)
    inputs = random_inputs(model.cell, forest, rng)
    expected = reference(forest, **inputs)
    for direct in (1, 2) if stacked else (0,):
        got = _run(model, forest, direct, **inputs)
        for name, value in expected.items():
            assert relative_error(got[name], value) < 1e-5, (name, direct)


@pytest.mark.parametrize("stem", sorted(CELLS))
def test_gate_by_gate_inference_matches_the_interpreter(small, stem, rng):
    """The direct kernel (block weight) and the hoisted one, forced each, against the interpreter."""
    _check_inference(small[stem], rng, CELLS[stem])


@pytest.mark.parametrize("k, stacked", WIDTHS[1:], ids=[f"K{k}" for k, _ in WIDTHS[1:]])
@pytest.mark.parametrize("stem", ["gate_lstm", "gate_nary"])
def test_wide_gate_by_gate_cells_match_the_interpreter(stem, k, stacked, tmp_path, rng):
    """At the edge of the direct kernel (K = 256 stacked, 257 not): inference, and training's gradients."""
    module = _load(stem, tmp_path, **k_dims(stem, k))
    _check_inference(module, rng, CELLS[stem], stacked)
    model, reference = twin_models(module, "cpu", int(rng.integers(0, 2**31)), rng)
    forest = chains(6, 3, 1) if "arity = 1" in CELLS[stem] else Forest.random(4, rng=rng, max_nodes=8, binary=True)
    inputs = random_inputs(model.cell, forest, rng)
    out, expected = model(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
    grads, expected_grads = model.backward(out, upstream), reference.backward(expected, upstream)
    for name, value in expected_grads.items():
        assert relative_error(grads[name], value) < 1e-5, name


@pytest.mark.parametrize("direct", [1, 2])
def test_the_gate_by_gate_lstm_matches_torch_lstm(small, direct, rng):
    """torch.nn.LSTM with W_ih = [W_i; W_f; W_g; W_o] (its gate order), W_hh likewise, b_ih the biases,
    b_hh zero: the same h and c at every step of every chain, through the direct and the hoisted kernels."""
    torch = pytest.importorskip("torch")
    model = small["gate_lstm"].GateLSTM(device="cpu", seed=int(rng.integers(0, 2**31)))
    params = {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()}
    model.load_params(params)
    lengths = [int(n) for n in rng.integers(5, 20, 12)]
    forest = chains(*lengths)
    x = rng.standard_normal((forest.num_nodes, 8)).astype(np.float32)
    out = _run(model, forest, direct, x=x)

    lstm = torch.nn.LSTM(8, 8)
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.from_numpy(np.concatenate([params[f"W_{g}"] for g in "ifgo"])))
        lstm.weight_hh_l0.copy_(torch.from_numpy(np.concatenate([params[f"U_{g}"] for g in "ifgo"])))
        lstm.bias_ih_l0.copy_(torch.from_numpy(np.concatenate([params[f"b_{g}"] for g in "ifgo"])))
        lstm.bias_hh_l0.zero_()
        start = 0
        for n in lengths:
            hs, (_, c) = lstm(torch.from_numpy(x[start : start + n]).unsqueeze(1))
            np.testing.assert_allclose(out["h"][start : start + n], hs[:, 0].numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(out["c"][start + n - 1], c[0, 0].numpy(), rtol=1e-5, atol=1e-6)
            start += n
