"""The compiled CPU path (device="cpu") against the reference interpreter.

Every comparison is per state/output: max |compiled - interp| / max |interp| <= 1e-5, plus equal
shapes, float32 and finite values. Kernels are built once per session into a private cache
(`CORTEXC_CACHE` points into pytest's temporary directory) and compiled modules are memoised, so
each distinct kernel is built by gcc once.

Known bugs are pinned as strict xfails (a fix turns them into XPASS failures: then drop the marker).
Tests that say "a regression" cover bugs found while writing this file and already fixed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest, Vocab, reference
from cortexc.ir.cell import Structure
from tests.helpers import EXAMPLES, random_graph, random_inputs, sst_path

TOL = 1e-5

# ----------------------------------------------------------------------------- session plumbing


_MODULES: dict[tuple, object] = {}
#: label -> worst relative error seen (printed at the end of the module, written to
#: $CORTEXC_ERROR_REPORT when set)
_ERRORS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _error_report():
    yield
    if not _ERRORS:
        return
    lines = [f"{label:60s} {err:.3e}" for label, err in sorted(_ERRORS.items())]
    print("\nmax relative error (compiled vs interp):\n" + "\n".join(lines))
    target = os.environ.get("CORTEXC_ERROR_REPORT")
    if target:
        Path(target).write_text("\n".join(lines) + "\n", encoding="utf-8")


def load(path, **dims):
    """`cortexc.load` memoised by (path, dims): one package and one build per distinct kernel."""
    key = (str(path), tuple(sorted(dims.items())))
    if key not in _MODULES:
        _MODULES[key] = cortexc.load(path, **dims)
    return _MODULES[key]


@pytest.fixture(scope="session")
def cell_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cells")


@pytest.fixture(scope="session")
def load_text(cell_dir):
    """Compile inline `.cell` text (written to `<cell_dir>/<stem>.cell`) and import its package."""

    def _load(text: str, stem: str, **dims):
        path = cell_dir / f"{stem}.cell"
        if not path.exists():
            path.write_text(text, encoding="utf-8")
        assert path.read_text(encoding="utf-8") == text, f"two different cells named {stem}"
        return load(path, **dims)

    return _load


# ----------------------------------------------------------------------------- comparison


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    if ref.size == 0:
        return 0.0
    scale = float(np.abs(ref).max()) or 1.0
    return float(np.abs(out.astype(np.float64) - ref).max()) / scale


def assert_close(out, ref, label: str, tol: float = TOL) -> dict[str, float]:
    """Every state/output of `ref` is in `out` with the same shape, float32, finite, within `tol`."""
    assert set(ref) <= set(out), f"{label}: compiled result lacks {sorted(set(ref) - set(out))}"
    errors = {}
    for name, expected in ref.items():
        got = out[name]
        assert got.shape == expected.shape, f"{label}: {name} has shape {got.shape}, expected {expected.shape}"
        assert got.dtype == np.float32, f"{label}: {name} is {got.dtype}"
        assert np.isfinite(expected).all(), f"{label}: the interpreter's {name} is not finite (bad test input)"
        assert np.isfinite(got).all(), f"{label}: compiled {name} has non-finite values where interp has none"
        errors[name] = err = rel_err(got, expected)
        key = f"{label.split('[')[0]}:{name}"
        _ERRORS[key] = max(_ERRORS.get(key, 0.0), err)
        assert err <= tol, f"{label}: {name} differs, max rel err {err:.3e} > {tol:g}"
    return errors


def compare(model, forest: Forest, inputs: dict, label: str, tol: float = TOL) -> dict:
    """Run `model` (device="cpu") and the interpreter with the same params; assert they agree."""
    out = model(forest, **inputs)
    ref = reference.run(model.cell, forest, model.params, inputs)
    assert_close(out, ref, label, tol)
    return out


def run_random(module, forest_for, seed: int, label: str, scale: float = 1.0) -> None:
    """Every cell class of the module on its forest, random inputs, seeded params."""
    for name in module.__all__:
        model = getattr(module, name)(device="cpu", seed=seed)
        forest = forest_for(model.cell) if callable(forest_for) else forest_for
        inputs = random_inputs(model.cell, forest, np.random.default_rng(seed), scale)
        compare(model, forest, inputs, f"{label}/{name}")


# ----------------------------------------------------------------------------- forests


def chain(n: int) -> Forest:
    """One chain of n nodes: node i's only child is i - 1 (depth n)."""
    return Forest.from_parents(np.r_[np.arange(1, n), -1])


def star(k: int) -> Forest:
    """One root with k leaf children."""
    return Forest.from_parents(np.r_[np.full(k, k), -1])


def singles(n: int) -> Forest:
    """n single-node trees: every node is a leaf and a root."""
    return Forest.from_parents(np.full(n, -1))


def caterpillar(depth: int) -> Forest:
    """A full binary tree of the given depth: a spine whose every node also has a leaf as child 1."""
    parents = [-1]  # node 0: the bottom leaf of the spine
    spine = 0
    for _ in range(depth):
        leaf = len(parents)
        parents.append(-1)
        node = len(parents)
        parents.append(-1)
        parents[spine] = node
        parents[leaf] = node
        spine = node
    return Forest.from_parents(parents)


def wide_tree(fan: int, rng: np.random.Generator) -> Forest:
    """A root with `fan` children, each with 0..3 leaf children (mixed child counts in one level)."""
    parents = []
    kids = []
    for _ in range(fan):
        below = int(rng.integers(0, 4))
        first = len(parents)
        parents.extend([-2] * below)
        kid = len(parents)
        parents.append(-2)
        for leaf in range(first, first + below):
            parents[leaf] = kid
        kids.append(kid)
    root = len(parents)
    parents.append(-1)
    for kid in kids:
        parents[kid] = root
    return Forest.from_parents(parents)


def permuted(forest: Forest, rng: np.random.Generator) -> Forest:
    """The same trees with node ids shuffled (parents may come before their children)."""
    perm = rng.permutation(forest.num_nodes)
    parents = np.full(forest.num_nodes, -1)
    parents[perm] = np.where(forest.parents >= 0, perm[forest.parents], -1)
    return Forest.from_parents(parents)


def forest_shapes(cell, seed: int) -> dict[str, Forest]:
    """Forests of varied shapes that the cell's structure accepts."""
    rng = np.random.default_rng(seed)
    arity = cell.arity
    fan = arity or 4
    shapes = {
        "single": singles(1),
        "all_leaves": singles(6),
        "chain100": chain(100),  # depth 100; with arity 2 every node misses child[1]
        "many_trees": Forest.random(150, rng, max_children=fan, max_nodes=8),
        "mixed": Forest.concat([singles(2), chain(7), Forest.random(12, rng, max_children=fan, max_nodes=40)]),
        "permuted": permuted(Forest.random(15, rng, max_children=fan, max_nodes=30), rng),
    }
    if arity is None:
        shapes["star40"] = star(40)
        shapes["wide40"] = wide_tree(40, rng)
        shapes["wide_random"] = Forest.random(4, rng, max_children=40, min_nodes=40, max_nodes=120)
    if arity == 1:
        shapes["chains"] = Forest.concat([chain(int(n)) for n in rng.integers(1, 60, 12)])
    if arity is not None and arity >= 2:
        shapes["binary"] = Forest.random(20, rng, binary=True, max_nodes=41)
        shapes["deep_binary"] = caterpillar(100)  # depth 101, full binary
        # nodes with fewer children than the arity: child[k] for a missing k reads 0
        shapes["missing_children"] = Forest.concat(
            [Forest.from_parents([1, 3, 3, -1, 5, -1]), Forest.random(10, rng, max_children=arity, max_nodes=30)]
        )
    if cell.steps is not None:  # a graph cell takes any graph, and trees and DAGs too
        shapes["graph"] = random_graph(40, 80, rng)
        shapes["graphs"] = Forest.concat([random_graph(int(n), int(n), rng) for n in rng.integers(4, 30, 6)])
    if cell.structure.shares_children:
        shapes["dag"] = Forest.random_dag(150, rng, max_children=arity or 4, max_parents=3)
        shapes["dag_shared"] = Forest.random_dag(60, rng, max_children=arity or 8, max_parents=8)
        shapes["dag_deep"] = Forest.random_dag(120, rng, max_children=1, max_parents=1)
    for forest in shapes.values():  # the generator must only make forests the cell accepts
        if cell.steps is None:
            forest.check_structure(cell.structure.shares_children, arity, cell.name)
    return shapes


# ----------------------------------------------------------------------------- the spec's examples

#: small dims where the defaults are large (the defaults run on SST below)
EXAMPLE_DIMS = {
    "treelstm": dict(X=16, H=12),
    "binary_treelstm": dict(V=64, X=16, H=12),
    "treernn": {},
    "dagrnn": {},
    "lstm": {},
    "mvrnn": {},
    "attn_treelstm": dict(X=16, H=12),
    "treelstm_dropout": dict(V=64, X=16, H=12),  # evaluation mode here (training: tests/language/test_dropout.py)
    "sst_treelstm": dict(V=64, X=16, H=12),  # evaluation mode (training: tests/api/test_torch.py)
    "rntn": dict(V=64, H=8),
    "tbcnn": dict(X=16, H=12),
    "ggnn": dict(X=16, H=12),
    "typed_daglstm": dict(X=16, H=12),
    "bitreelstm": dict(V=64, X=16, H=12),
}


def test_every_example_is_covered():
    assert sorted(p.stem for p in EXAMPLES.glob("*.cell")) == sorted(EXAMPLE_DIMS)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stem", sorted(EXAMPLE_DIMS))
def test_example_matches_interp_on_varied_forests(stem, seed):
    module = load(EXAMPLES / f"{stem}.cell", **EXAMPLE_DIMS[stem])
    for name in module.__all__:
        model = getattr(module, name)(device="cpu", seed=seed)
        for shape, forest in forest_shapes(model.cell, seed).items():
            inputs = random_inputs(model.cell, forest, np.random.default_rng([seed, forest.num_nodes]))
            compare(model, forest, inputs, f"example {stem}[{shape}, seed={seed}]")


@pytest.mark.slow
@pytest.mark.parametrize("H", [7, 33])
@pytest.mark.parametrize("stem", sorted(EXAMPLE_DIMS))
def test_odd_dim_overrides(stem, H):
    """-D H=7 / H=33: sizes that are not multiples of the SIMD width (GEMM tails, partial panels)."""
    dims = {**EXAMPLE_DIMS[stem], "H": H}
    if "X" in dims:
        dims["X"] = 10
    module = load(EXAMPLES / f"{stem}.cell", **dims)
    for name in module.__all__:
        model = getattr(module, name)(device="cpu", seed=H)
        assert dict(model.cell.dims)["H"] == H
        forests = forest_shapes(model.cell, H)
        forest = (
            Forest.concat([forests["mixed"], forests["chain100"]])
            if not model.cell.structure.shares_children
            else forests["dag"]
        )
        inputs = random_inputs(model.cell, forest, np.random.default_rng(H))
        out = compare(model, forest, inputs, f"-D H={H} {stem}")
        assert out["h"].shape == (forest.num_nodes, H)


def test_device_interp_is_the_reference():
    module = load(EXAMPLES / "treelstm.cell", **EXAMPLE_DIMS["treelstm"])
    cpu = module.ChildSumTreeLSTM(device="cpu", seed=3)
    eager = module.ChildSumTreeLSTM(device="interp", seed=3)
    for name in cpu.params:
        np.testing.assert_array_equal(cpu.params[name], eager.params[name])
    forest = Forest.random(5, 3, max_children=5)
    inputs = random_inputs(cpu.cell, forest, np.random.default_rng(3))
    ref = reference.run(cpu.cell, forest, cpu.params, inputs)
    got = eager(forest, **inputs)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name])
    assert_close(cpu(forest, **inputs), ref, "device interp")


def test_same_forest_twice_gives_identical_results():
    module = load(EXAMPLES / "dagrnn.cell")
    model = module.DagRNN(device="cpu", seed=0)
    forest = Forest.random_dag(200, 0)
    inputs = random_inputs(model.cell, forest, np.random.default_rng(0))
    first = {k: v.copy() for k, v in model(forest, **inputs).items()}
    second = model(forest, **inputs)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])


def test_inputs_of_any_float_dtype_and_layout():
    """float64 and non-contiguous inputs are converted; int64 indices accepted."""
    module = load(EXAMPLES / "binary_treelstm.cell", **EXAMPLE_DIMS["binary_treelstm"])
    model = module.BinaryTreeLSTM(device="cpu", seed=0)
    forest = Forest.random(8, 0, binary=True)
    words = np.random.default_rng(0).integers(0, 64, forest.num_nodes)  # int64
    compare(model, forest, {"word": words}, "int64 word ids")
    module = load(EXAMPLES / "treernn.cell")
    model = module.TreeRNN(device="cpu", seed=0)
    x = np.random.default_rng(0).standard_normal((64, forest.num_nodes)).T  # float64, Fortran order
    assert not x.flags.c_contiguous
    out = model(forest, x=x)
    ref = reference.run(model.cell, forest, model.params, {"x": x.astype(np.float32)})
    assert_close(out, ref, "float64 fortran x")


# ----------------------------------------------------------------------------- stress cells

STRESS = {
    # every elementwise function, softmax/log_softmax, on per-node and per-child values
    "elementwise": (
        """
cell EW on tree {
    dim X = 7, H = 6
    input x[X]
    param W[H, X], U[H, H], b[H]
    state h[H], c[H]
    node {
        a = W @ x + b
        s = sum(U @ child.h) + x[0:H] * 0.5
        h = sigmoid(a) + tanh(s) + relu(a - s) + exp(-abs(a)) + log(1 + abs(s)) + softplus(a) - softplus(-s)
        c = softmax(a) + log_softmax(s + mean(child.c)) + max(child.c) / (1 + sum(1)) + sum(softmax(child.h))
    }
}
""",
        "tree",
    ),
    # mean / max / sum over children, sum(1), mean(1), reductions of per-node values, a [1] state
    "reductions": (
        """
cell Red on tree {
    dim X = 6, H = 5
    input x[X]
    param W[H, X], U[H, H], b[H], one[1] init ones
    state h[H], n[1]
    node {
        k = sum(1)
        n = one * k + one * mean(1)
        m = mean(tanh(U @ child.h + W @ x))
        mx = max(child.h * 2 - 1) + max(-abs(child.h) - 5)
        r = mean(x[1:] * 2 + child.h) + max(x[:H] * 0.0 + k + child.h)
        h = m + mx + sum(child.h) / H + b * sum(1) + r + b * sum(H)
    }
}
""",
        "tree",
    ),
    # per-child GEMM operands, per-node and per-child values mixed, per-child concat and softmax
    "per_child_gemm": (
        """
cell PC on tree {
    dim X = 7, H = 6
    input x[X]
    param W[H, X], U[H, H], V[H, H], Q[H, 2*H], b[H]
    state h[H]
    node {
        p = W @ x
        g = sigmoid(U @ child.h + p)
        q = V @ (g * child.h + p)
        r = Q @ concat(child.h, p)
        z = softmax(q + r)
        h = tanh(sum(z * child.h) + mean(U @ (child.h * x[0:H])) + p + b)
    }
}
""",
        "tree",
    ),
    # matrix states, concat of matrices, per-node matrix products (MV-RNN-like), child[k] of arity 3
    "matrix_states": (
        """
cell MS on tree(arity = 3) {
    dim X = 4, H = 5
    input x[X]
    param W_x[H, X], W[H, 3*H], W_M[H, 3*H], b[H], A0[H, H] init normal(0, 0.3), P[H, H]
    state h[H], A[H, H]
    leaf { h = tanh(W_x @ x); A = A0 }
    node {
        v = concat(child[2].A @ child[0].h, child[0].A @ child[1].h, child[1].A @ (W_x @ x))
        h = tanh(W @ v + b + W_x @ x)
        M = concat(child[0].A, child[1].A, child[2].A)
        A = tanh(W_M @ M + A0) + P @ A0 * 0.1 + sum(child.A) - max(child.A)
    }
    output y[H] = A @ h + P @ (W_x @ x)
}
""",
        "tree3",
    ),
    # param-only expressions (W @ b, sigmoid(b), A @ B), dims as scalars, outputs (also at root)
    "param_only": (
        """
cell PO on tree(arity = 2) {
    dim X = 3, H = 5
    input x[X]
    param W[H, H], b[H], W_x[H, X], A[H, H], B[H, H]
    state h[H], M[H, H]
    node {
        h = tanh(W @ b + sigmoid(b) * (W_x @ x) + child[0].h + child[1].h * H + X)
        M = A @ B + child[1].M
    }
    output o[H] = W @ b + h
    output r[H] at root = softmax(W @ h)
    output s[H] at root = b
}
""",
        "binary",
    ),
    # a state read after its assignment; nothing child-independent to hoist; a leaf block
    "no_hoist": (
        """
cell SR on tree(arity = 2) {
    dim X = 4, H = 4
    input x[X]
    param U[H, 2*H], b[H]
    state h[H], c[H]
    leaf { c = x * 0.5; h = tanh(c) }
    node {
        c = U @ concat(child[0].h, child[1].h) + child[0].c * x + b
        h = tanh(c) * sigmoid(c) + c
    }
    output y[H] = h - c
}
""",
        "binary",
    ),
    # everything but one term is child-independent (hoisted)
    "all_but_one_hoisted": (
        """
cell AB on tree {
    dim X = 9, H = 8
    input x[X]
    param W1[H, X], W2[H, X], W3[H, X], b[H]
    state h[H]
    node {
        a = tanh(W1 @ x + b)
        d = sigmoid(W2 @ x) * relu(W3 @ x)
        h = a * d + a + sum(child.h)
    }
}
""",
        "tree",
    ),
    # an embedding look-up (hoisted), dims as scalars, slices with omitted bounds
    "embed_slices": (
        """
cell EM on tree {
    dim V = 13, X = 5, H = 6
    input w : index[V], x[X]
    param E[V, X] init normal(0, 1), W[H, X], U[H, H]
    state h[H]
    node {
        e = E[w]
        h = tanh(W @ (e + x) + U @ sum(child.h) / V + concat(e, x[0:H-X])[:] * X) + concat(x[:2], x[X-5:])[1:]
    }
}
""",
        "tree",
    ),
    # a mixture: per-child softmax, max of a per-node value, matmul of exp(child[k]), slices of concats
    "misc": (
        """
cell MI on tree(arity = 3) {
    dim X = 6, H = 6
    input x[X]
    param W[H, X], U[H, H], A[H, H] init normal(0, 0.5), b[H]
    state h[H], M[H, H]
    leaf { h = x; M = A * 2 }
    node {
        k = sum(1)
        s = sum(softmax(child.h)) + mean(1) * x + max(x + child.h) + k * x + k
        e = W @ (exp(child[1].h) * x) + U @ (-child[0].h) + max(child.h - 3)
        t = concat(child.h, x)[2:8]
        h = tanh(s + e + sum(t) + U @ concat(x[0:3], child[2].h[3:]))
        M = tanh(A @ exp(child[0].M) + child[2].M * k)
    }
    output o[H] = M @ h + A @ x
}
""",
        "tree3",
    ),
    # param-only matrices as left operands ((-W) @ x, sigmoid(V) @ x), a state that is entirely hoisted,
    # outputs reading an embedding, a matrix state and log_softmax at root
    "param_matrices": (
        """
cell NM on tree(arity = 2) {
    dim X = 5, H = 4
    input x[X], w : index[6]
    param W[H, X], V[H, X], A[H, H], E[6, X]
    state h[H], c[H], M[H, H]
    node {
        c = W @ x
        h = (-W) @ x + (W * 2 + V) @ x + sigmoid(V) @ x + c * 0.5 + child[0].h + -(A @ child[1].c)
        M = tanh(0.2 * (child[0].M @ child[0].M) + A + (A @ A) / H + child[1].M * 0.5)
    }
    output e[X] = E[w] + x
    output m[H] = M @ c
    output l[H] at root = log_softmax(h) * 2
}
""",
        "binary",
    ),
    # mean/max/sum of per-child matrices and per-child matrix products, divisions by per-node values
    "child_matrices": (
        """
cell MM on tree {
    dim X = 3, H = 3
    input x[X]
    param W[H, X], A0[H, H] init uniform(-1, 1)
    state h[H], A[H, H]
    leaf { h = W @ x; A = A0 }
    node {
        A = mean(child.A) + max(child.A @ A0) - sum(child.A / (1 + abs(child.A)))
        h = A @ (W @ x) + mean(log_softmax(child.h)) + max(child.h / (2 + abs(W @ x)))
    }
}
""",
        "tree",
    ),
    # two cells in one file; the second on dag(arity = 2) with an output at root
    "two_cells": (
        """
cell One on tree(arity = 1) {
    dim X = 3, H = 7
    input x[X]
    param W[H, X], U[H, H]
    state h[H]
    node { h = tanh(W @ x + U @ child[0].h) }
}
cell Two on dag(arity = 2) {
    dim X = 3, H = 7, C = 2
    input x[X]
    param W[H, X], U0[H, H], U1[H, H], S[C, H]
    state h[H]
    node { h = relu(W @ x + U0 @ child[0].h + U1 @ child[1].h) }
    output y[C] at root = log_softmax(S @ h)
}
""",
        "by_cell",
    ),
}


def stress_forest(kind: str, cell, seed: int) -> Forest:
    rng = np.random.default_rng(seed)
    if kind == "by_cell":
        kind = {"One": "chain", "Two": "dag2"}[cell.name]
    if kind == "tree":
        return Forest.concat([singles(2), star(40), chain(30), Forest.random(10, rng, max_children=6, max_nodes=30)])
    if kind == "tree3":
        return Forest.concat([singles(1), chain(30), Forest.random(10, rng, max_children=3, max_nodes=30)])
    if kind == "binary":
        return Forest.concat(
            [
                singles(1),
                chain(20),
                Forest.random(8, rng, binary=True, max_nodes=31),
                Forest.random(8, rng, max_children=2, max_nodes=20),
            ]
        )
    if kind == "chain":
        return Forest.concat([chain(int(n)) for n in rng.integers(1, 40, 6)])
    if kind == "dag2":
        return Forest.random_dag(80, rng, max_children=2, max_parents=4)
    raise AssertionError(kind)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stem", sorted(STRESS))
def test_stress_cell_matches_interp(load_text, stem, seed):
    text, kind = STRESS[stem]
    module = load_text(text, stem)
    run_random(module, lambda cell: stress_forest(kind, cell, seed), seed, f"stress {stem}[seed={seed}]")


def test_stress_cells_hoist_as_described():
    """The cells meant to stress hoisting really do: nothing hoisted / everything but one term."""
    no_hoist = cortexc.compile_source(STRESS["no_hoist"][0], "no_hoist.cell")[0]
    assert no_hoist.pre is None
    hoisted = cortexc.compile_source(STRESS["all_but_one_hoisted"][0], "ab.cell")[0]
    assert hoisted.pre is not None and len(hoisted.pre.results) >= 1
    embed = cortexc.compile_source(STRESS["embed_slices"][0], "em.cell")[0]
    assert embed.pre is not None


def test_two_cells_are_two_classes(load_text):
    module = load_text(STRESS["two_cells"][0], "two_cells")
    assert module.__all__ == ["One", "Two"]
    assert module.Two.cell.structure == Structure.DAG and module.Two.cell.arity == 2
    with pytest.raises(cortexc.ForestError):  # One is a chain cell
        module.One(device="cpu")(star(2), x=np.zeros((3, 3), np.float32))


#: cells without a leaf block whose leaf body folds to constants (a reduction over no children is 0):
#: `specialize` must give the folded values the domain of their new operands (a regression: at b95a5d8
#: these raised IRVerifyError "domain NODE but the rule gives PARAM" from cortexc.load)
LEAFLESS = {
    "rnn_without_input": """
cell NoInput on tree {
    dim H = 4
    param U[H, H], b[H] init uniform(-1, 1)
    state h[H]
    node { h = tanh(sum(U @ child.h) + b) }
}
""",
    "one_plus_sum": """
cell OnePlusSum on tree {
    dim H = 3
    state h[H]
    node { h = 1 + sum(child.h) * 0.5 }
}
""",
    "exp_of_child_as_gemm_operand": """
cell ExpChild on tree(arity = 2) {
    dim X = 3, H = 4
    input x[X]
    param W[H, H], V[H, X]
    state h[H]
    node { h = tanh(W @ exp(child[1].h) + V @ x) }
}
""",
    "softmax_of_reduction": """
cell SoftmaxSum on tree {
    dim H = 3
    param b[H]
    state h[H]
    node { h = softmax(sum(child.h) + b) + sigmoid(b) * (1 - mean(child.h)) }
}
""",
    "matrix_of_params": """
cell ParamMatrix on tree(arity = 2) {
    dim H = 3
    param A[H, H], b[H] init uniform(-1, 1)
    state h[H], M[H, H]
    node {
        M = tanh(child[0].M @ child[1].M) + A * 2 + (A @ A) / H
        h = tanh(M @ b + child[0].h)
    }
}
""",
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("stem", sorted(LEAFLESS))
def test_cells_without_leaf_whose_leaf_is_constant(load_text, stem, seed):
    module = load_text(LEAFLESS[stem], stem)
    run_random(
        module,
        lambda cell: Forest.concat(
            [singles(2), chain(5), Forest.random(6, seed, max_children=cell.arity or 4, max_nodes=20)]
        ),
        seed,
        f"leafless {stem}[seed={seed}]",
    )


# ----------------------------------------------------------------------------- edge-case forests


@pytest.mark.parametrize("stem", ["treelstm", "binary_treelstm", "dagrnn", "lstm"])
def test_single_node_and_all_leaf_forests(stem):
    module = load(EXAMPLES / f"{stem}.cell", **EXAMPLE_DIMS[stem])
    model = getattr(module, module.__all__[0])(device="cpu", seed=5)
    for label, forest in (("one single-node tree", singles(1)), ("all leaves", singles(9))):
        inputs = random_inputs(model.cell, forest, np.random.default_rng(5))
        out = compare(model, forest, inputs, f"edge {stem} {label}")
        assert out["h"].shape[0] == forest.num_nodes


@pytest.mark.parametrize("stem", ["treelstm", "binary_treelstm"])
def test_empty_forest(stem):
    module = load(EXAMPLES / f"{stem}.cell", **EXAMPLE_DIMS[stem])
    model = getattr(module, module.__all__[0])(device="cpu", seed=0)
    forest = Forest.from_parents(np.zeros(0, np.int64))
    inputs = random_inputs(model.cell, forest, np.random.default_rng(0))
    out = model(forest, **inputs)
    ref = reference.run(model.cell, forest, model.params, inputs)
    for name in ref:
        assert out[name].shape == ref[name].shape


# ----------------------------------------------------------------------------- params


def test_load_params_takes_effect():
    """New values for GEMM weights (stacked and packed), biases and the embedding all reach the kernels."""
    module = load(EXAMPLES / "binary_treelstm.cell", **EXAMPLE_DIMS["binary_treelstm"])
    model = module.BinaryTreeLSTM(device="cpu", seed=1)
    forest = Forest.random(12, 1, binary=True, max_nodes=31)
    inputs = random_inputs(model.cell, forest, np.random.default_rng(1))
    before = {k: v.copy() for k, v in compare(model, forest, inputs, "params initial").items()}

    rng = np.random.default_rng(7)
    model.load_params({name: rng.standard_normal(p.shape) * 0.5 for name, p in model.params.items()})  # float64
    after = compare(model, forest, inputs, "params after load_params (all)")
    assert rel_err(after["h"], before["h"]) > 1e-2

    # one weight of a stacked GEMM (U_iou and U_f share the operand concat(child h)): re-packed alone
    stacked = model.params["U_f"] * -2.0
    model.load_params({"U_f": stacked})
    np.testing.assert_array_equal(model.params["U_f"], stacked.astype(np.float32))
    compare(model, forest, inputs, "params after load_params (U_f only)")

    # a bias and the output projection only
    model.load_params({"b_iou": np.full(model.params["b_iou"].shape, 0.3), "W_s": model.params["W_s"] * 3})
    compare(model, forest, inputs, "params after load_params (bias, W_s)")


def test_load_params_before_first_run_and_from_npz(tmp_path):
    module = load(EXAMPLES / "treelstm.cell", **EXAMPLE_DIMS["treelstm"])
    source = module.ChildSumTreeLSTM(device="cpu", seed=11)
    path = tmp_path / "p.npz"
    source.save_params(path)
    model = module.ChildSumTreeLSTM(device="cpu", seed=0)
    model.load_params(path)  # before anything is built or packed
    for name in source.params:
        np.testing.assert_array_equal(model.params[name], source.params[name])
    forest = Forest.random(10, 2, max_children=5)
    inputs = random_inputs(model.cell, forest, np.random.default_rng(2))
    out = compare(model, forest, inputs, "params from npz")
    np.testing.assert_array_equal(out["h"], source(forest, **inputs)["h"])


def test_load_params_checks_shapes_and_names():
    module = load(EXAMPLES / "treelstm.cell", **EXAMPLE_DIMS["treelstm"])
    model = module.ChildSumTreeLSTM(device="cpu", seed=0)
    with pytest.raises(cortexc.InputError):
        model.load_params({"W_iou": np.zeros((3, 3))})
    with pytest.raises(cortexc.InputError):
        model.load_params({"nope": np.zeros(3)})


def test_param_arrays_are_read_only():
    module = load(EXAMPLES / "treelstm.cell", **EXAMPLE_DIMS["treelstm"])
    model = module.ChildSumTreeLSTM(device="cpu", seed=0)
    for name, array in model.params.items():
        assert array.dtype == np.float32
        assert not array.flags.writeable, name
        with pytest.raises(ValueError):
            array[...] = 0


def test_param_mapping_cannot_be_assigned():
    """Assigning into `model.params` would change device="interp" but not the packed compiled weights
    (a regression: at b95a5d8 `params` was the model's own dict and took the assignment silently)."""
    module = load(EXAMPLES / "treelstm.cell", **EXAMPLE_DIMS["treelstm"])
    model = module.ChildSumTreeLSTM(device="cpu", seed=0)
    with pytest.raises(TypeError):
        model.params["b_iou"] = np.ones_like(model.params["b_iou"])
    with pytest.raises(TypeError):
        del model.params["b_iou"]
    assert float(np.abs(model.params["b_iou"]).max()) == 0.0  # init zeros, unchanged


# ----------------------------------------------------------------------------- input validation


@pytest.fixture(scope="module")
def small_models():
    tree = load(EXAMPLES / "treelstm.cell", **EXAMPLE_DIMS["treelstm"]).ChildSumTreeLSTM(device="cpu", seed=0)
    binary = load(EXAMPLES / "binary_treelstm.cell", **EXAMPLE_DIMS["binary_treelstm"]).BinaryTreeLSTM(
        device="cpu", seed=0
    )
    tree(singles(1), x=np.zeros((1, 16), np.float32))  # built: errors below come from validation, not the build
    return tree, binary


def _bad_calls(tree, binary):
    forest = Forest.random(3, 0, max_children=3)
    n = forest.num_nodes
    x = np.zeros((n, 16), np.float32)
    shared = Forest([0, 0, 1, 3], [0, 0, 1])  # node 0 is read by nodes 1 and 2
    small = Forest.from_parents([2, 2, -1])
    return {
        "too few rows": (cortexc.InputError, lambda: tree(forest, x=x[:-1])),
        "too many rows": (cortexc.InputError, lambda: tree(forest, x=np.zeros((n + 1, 16), np.float32))),
        "wrong width": (cortexc.InputError, lambda: tree(forest, x=np.zeros((n, 15), np.float32))),
        "int for a float input": (cortexc.InputError, lambda: tree(forest, x=np.zeros((n, 16), np.int32))),
        "unknown input": (cortexc.InputError, lambda: tree(forest, x=x, y=x)),
        "missing input": (cortexc.InputError, lambda: tree(forest)),
        "not a forest": (cortexc.InputError, lambda: tree([1, 2], x=x)),
        "index too large": (cortexc.InputError, lambda: binary(small, word=np.array([0, 64, 1]))),
        "negative index": (cortexc.InputError, lambda: binary(small, word=np.array([0, -1, 1]))),
        "float index": (cortexc.InputError, lambda: binary(small, word=np.array([0.0, 1.0, 1.0]))),
        "index 2-d": (cortexc.InputError, lambda: binary(small, word=np.zeros((3, 1), np.int32))),
        "shared node in a tree cell": (cortexc.ForestError, lambda: tree(shared, x=np.zeros((3, 16), np.float32))),
        "arity violation": (
            cortexc.ForestError,
            lambda: binary(Forest.from_parents([3, 3, 3, -1]), word=np.zeros(4, np.int32)),
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls(None, None)))
def test_bad_input_is_rejected_before_launch(small_models, case, monkeypatch):
    tree, binary = small_models
    error, call = _bad_calls(tree, binary)[case]

    def no_launch(*args, **kwargs):  # validation must come first: nothing reaches the kernels
        raise AssertionError("the compiled forward was launched")

    monkeypatch.setattr(tree._executor, "forward", no_launch)
    if binary._executor is not None:
        monkeypatch.setattr(binary._executor, "forward", no_launch)
    monkeypatch.setattr("cortexc.runtime.build.build_shared", no_launch)
    with pytest.raises(error) as info:
        call()
    assert str(info.value)


def test_index_error_names_the_node(small_models):
    _, binary = small_models
    with pytest.raises(cortexc.InputError, match="node 1"):
        binary(Forest.from_parents([2, 2, -1]), word=np.array([0, 99, 1]))


def test_dag_cell_accepts_shared_nodes_and_computes_them_once():
    module = load(EXAMPLES / "dagrnn.cell")
    model = module.DagRNN(device="cpu", seed=0)
    forest = Forest([0, 0, 1, 3, 5], [0, 0, 1, 0, 2])  # node 0 has three readers
    assert not forest.is_tree
    inputs = random_inputs(model.cell, forest, np.random.default_rng(0))
    compare(model, forest, inputs, "dag shared node")


# ----------------------------------------------------------------------------- SST


def _sst_lines(split: str) -> list[str]:
    return [line for line in sst_path(split).read_text(encoding="utf-8").splitlines() if line.strip()]


def _word_ids(vocab: Vocab, forest: Forest, V: int) -> np.ndarray:
    ids = vocab.encode(forest)
    return np.where(ids < V, ids, 1).astype(np.int32)


def _tree_rows(forest: Forest) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last node of every tree (trees are contiguous, root last: post-order)."""
    ends = forest.roots + 1
    return np.r_[0, ends[:-1]], ends


def _rows_of_trees(forest: Forest, trees: np.ndarray) -> np.ndarray:
    starts, ends = _tree_rows(forest)
    return np.concatenate([np.arange(starts[t], ends[t]) for t in trees])


@pytest.fixture(scope="module")
def sst_dev():
    lines = _sst_lines("dev")
    forest = Forest.from_ptb(lines)
    return lines, forest, Vocab.build([forest])


@pytest.mark.slow
@pytest.mark.parametrize("H", [150, 256])
def test_binary_treelstm_on_sst_dev(sst_dev, H):
    """Default dims (V=21701, X=300, H=150) and -D H=256; the whole dev set compiled, 150 trees interpreted."""
    lines, forest, vocab = sst_dev
    module = load(EXAMPLES / "binary_treelstm.cell", **({} if H == 150 else {"H": H}))
    model = module.BinaryTreeLSTM(device="cpu", seed=0)
    V = model.cell.inputs[0].index_range
    full = model(forest, word=_word_ids(vocab, forest, V))
    assert full["h"].shape == (forest.num_nodes, H) and full["logits"].shape == (forest.num_nodes, 5)
    trees = np.sort(np.random.default_rng(H).choice(forest.num_trees, 150, replace=False))
    subset = Forest.from_ptb([lines[t] for t in trees])
    ref = reference.run(model.cell, subset, model.params, {"word": _word_ids(vocab, subset, V)})
    rows = _rows_of_trees(forest, trees)
    assert_close({k: v[rows] for k, v in full.items()}, ref, f"SST dev binary H={H}")


def test_child_sum_treelstm_on_sst_dev(sst_dev):
    lines, forest, _ = sst_dev
    module = load(EXAMPLES / "treelstm.cell")
    model = module.ChildSumTreeLSTM(device="cpu", seed=0)
    subset = Forest.from_ptb(lines[:100])
    inputs = random_inputs(model.cell, subset, np.random.default_rng(0))
    out = compare(model, subset, inputs, "SST dev child-sum")
    assert out["h"].shape == (subset.num_nodes, 150)


@pytest.fixture(scope="module")
def sst_train():
    lines = _sst_lines("train")
    forest = Forest.from_ptb(lines)
    return lines, forest, Vocab.build([forest])


@pytest.mark.parametrize("count", [1, 10, 100])
def test_batch_sizes_on_sst_train(sst_train, count):
    lines, _, vocab = sst_train
    model = load(EXAMPLES / "binary_treelstm.cell").BinaryTreeLSTM(device="cpu", seed=0)
    forest = Forest.from_ptb(lines[:count])
    assert forest.num_trees == count
    compare(model, forest, {"word": _word_ids(vocab, forest, 21701)}, f"SST train batch {count}")


@pytest.mark.slow
def test_all_of_sst_train_in_one_call(sst_train):
    """8544 trees at once == the same trees in separate batches == the interpreter on 200 random trees."""
    lines, forest, vocab = sst_train
    assert forest.num_trees == len(lines) == 8544
    model = load(EXAMPLES / "binary_treelstm.cell").BinaryTreeLSTM(device="cpu", seed=0)
    full = model(forest, word=_word_ids(vocab, forest, 21701))

    # the forest is the concatenation of its slices; three of them run separately give the same rows
    bounds = np.linspace(0, len(lines), 17).astype(int)
    slices = [Forest.from_ptb(lines[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    joined = Forest.concat(slices)
    for name in ("child_ptr", "child_idx", "roots", "level", "level_order"):
        np.testing.assert_array_equal(getattr(joined, name), getattr(forest, name), err_msg=name)
    for part in (0, 7, 15):
        batch = slices[part]
        alone = model(batch, word=_word_ids(vocab, batch, 21701))
        rows = _rows_of_trees(forest, np.arange(bounds[part], bounds[part + 1]))
        for name in full:
            err = rel_err(alone[name], full[name][rows])
            key = f"SST train full vs batches:{name}"
            _ERRORS[key] = max(_ERRORS.get(key, 0.0), err)
            assert err <= 1e-6, f"{name}: slice {part} alone and in the full forest differ by {err:.3e}"

    trees = np.sort(np.random.default_rng(0).choice(forest.num_trees, 200, replace=False))
    subset = Forest.from_ptb([lines[t] for t in trees])
    ref = reference.run(model.cell, subset, model.params, {"word": _word_ids(vocab, subset, 21701)})
    rows = _rows_of_trees(forest, trees)
    assert_close({k: v[rows] for k, v in full.items()}, ref, "SST train full vs interp (200 trees)")
