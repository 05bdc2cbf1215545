"""The version 2 features (`[1]` broadcasting, `v[k]`, `child_softmax`, `dropout`) attacked as a new user
and a hostile tester would: each test here failed before the fix it names (see docs/architecture.md).

References: the interpreter (`cortexc.reference` through `device="interp"`) and, where the
contract states a formula, NumPy written here from the contract alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.cli import main
from cortexc.runtime import philox

# ------------------------------------------------------------------ child_softmax at large finite scores
#: the score is a per-child value plus a per-node one: before the fix the C and CUDA step evaluated the
#: score's expression twice (once for the max, once for the exponential), and under -ffast-math gcc
#: reassociated `(child + node) - top` into `child + (node - top)`: at |scores| ~ 1e30 the two roundings
#: differ by far more than 88, so `expf` overflowed to inf and the weights became inf / inf = NaN
LARGE_SCORES = """
cell Large on tree {
    dim H = 3
    input x[H], s[1], t[1]
    state h[H], z[1], w[1]
    node {
        a = child_softmax(child.z + t)
        h = x + sum(a * child.h)
        z = s
        w = sum(a)
    }
}
"""


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    path = tmp_path_factory.mktemp("large") / "large.cell"
    path.write_text(LARGE_SCORES, encoding="utf-8")
    return cortexc.load(path, out_dir=path.parent / "pkg").Large


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda-emu", marks=pytest.mark.slow)])
def test_child_softmax_of_large_finite_scores_is_finite_and_sums_to_one(large, device, rng):
    forest = Forest.concat([Forest.random(8, rng=rng, max_children=5, max_nodes=16), Forest.from_parents([2, 2, -1])])
    n = forest.num_nodes
    inputs = {
        "x": rng.standard_normal((n, 3)).astype(np.float32),
        "s": (rng.uniform(-1, 1, (n, 1)) * 1e30).astype(np.float32),
        "t": (rng.uniform(-1, 1, (n, 1)) * 3e30).astype(np.float32),
    }
    out = large(device=device)(forest, **inputs)
    expected = large(device="interp")(forest, **inputs)
    internal = np.array([len(forest.children(i)) > 0 for i in range(n)])
    assert np.isfinite(expected["h"]).all()
    assert np.isfinite(out["h"]).all() and np.isfinite(out["w"]).all()
    np.testing.assert_allclose(out["w"][internal], 1.0, rtol=1e-6)
    np.testing.assert_allclose(out["h"], expected["h"], rtol=1e-5, atol=1e-5)


VECTOR_SOFTMAX = """
cell VLarge on tree {
    dim H = 6
    input x[H], y[H]
    state p[H], q[H]
    node {
        p = softmax(x + y)
        q = log_softmax(x + y)
    }
}
"""


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
def test_vector_softmax_of_large_finite_sums_matches_the_interpreter(device, rng, tmp_path):
    """The vector softmax step keeps each x it computed for the max (as child_softmax does): the row's
    exponentials then never see an x rounded otherwise than the max, whatever fast-math does."""
    path = tmp_path / "vlarge.cell"
    path.write_text(VECTOR_SOFTMAX, encoding="utf-8")
    cls = cortexc.load(path, out_dir=tmp_path / "pkg").VLarge
    forest = Forest.random(6, rng=rng, max_children=3, max_nodes=12)
    n = forest.num_nodes
    inputs = {
        "x": (rng.uniform(-1, 1, (n, 6)) * 1e30).astype(np.float32),
        "y": (rng.uniform(-1, 1, (n, 6)) * 3e30).astype(np.float32),
    }
    out = cls(device=device)(forest, **inputs)
    expected = cls(device="interp")(forest, **inputs)
    assert np.isfinite(out["p"]).all()
    np.testing.assert_allclose(out["p"].sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out["p"], expected["p"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["q"], expected["q"], rtol=1e-5)


# ------------------------------------------------------------------ v[k] of something that is not a vector
def _cell(body: str) -> str:
    """A cell whose node block is line 6; its body starts at column 12."""
    return "\n".join(
        [
            "cell C on tree {",
            "    dim X = 4, H = 4",
            "    input x[X], w : index[4]",
            "    param W[H, X], M[H, H], E[4, H]",
            "    state h[H]",
            f"    node {{ {body} }}",
            "}",
            "",
        ]
    )


#: before the fix a constant subscript of a computed matrix or a scalar said "only a param matrix can be
#: indexed by an index input", about an index that was a constant, not an input
NOT_A_VECTOR = [
    (
        "computed-matrix",
        "m = M * 2; h = W @ x * m[1]",
        35,
        "m[1]: a subscript v[k] takes one element of a vector, but m is a [4, 4] matrix",
    ),
    (
        "scalar-literal",
        "h = W @ x * 3[0]",
        24,
        "3[0]: a subscript v[k] takes one element of a vector, but 3 is a scalar",
    ),
    ("index-input", "h = W @ x * w[0]", 24, "'w' is an index input: it can only select a row of a param, as E[w]"),
    ("param-matrix", "h = W @ x * M[1]", 26, "M[1]: the row must be an index input"),
]


@pytest.mark.parametrize(("body", "col", "fragment"), [e[1:] for e in NOT_A_VECTOR], ids=[e[0] for e in NOT_A_VECTOR])
def test_a_subscript_of_a_non_vector_says_what_v_k_needs(body, col, fragment, tmp_path, capsys):
    path = tmp_path / "t.cell"
    path.write_text(_cell(body), encoding="utf-8")
    assert main(["compile", str(path), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    first, echoed, caret = err.splitlines()[:3]
    assert first.startswith(f"{path}:6:{col}: error: "), err
    assert fragment in first, err
    assert caret.index("^") == col - 1 and echoed == _cell(body).splitlines()[5], err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ sites: a leaf block, two cells, outputs
#: the sites of A: leaf 0, node 1 2 3, outputs 4 5 (text order); B counts its own from 0. x holds powers
#: of two, b too, and the node block's scales are 2 and 4, so every sum is exact and compared bitwise
TWO_CELLS = """
cell A on tree {
    dim X = 3, H = 3
    input x[X]
    param b[H]
    state h[H]
    leaf { h = dropout(x, 1 / 2) }
    node { h = dropout(x, 0.5) + sum(dropout(child.h, 1 - 1 / (H + 1))) + dropout(b, 0.5 * 3 / 2) }
    output y[H] at root = dropout(h, 1 / H)
    output z[H] = dropout(h * 2, 0.5)
}
cell B on tree {
    dim X = 3, H = 3
    input x[X]
    state h[H]
    node { h = dropout(x, 0.5) + sum(child.h) }
}
"""


@pytest.fixture(scope="module")
def two_cells(tmp_path_factory):
    path = tmp_path_factory.mktemp("sites") / "two.cell"
    path.write_text(TWO_CELLS, encoding="utf-8")
    return cortexc.load(path, out_dir=path.parent / "pkg")


def _scaled_mask(seed: int, site: int, p: float, node: int, slot: int) -> np.ndarray:
    return np.where(philox.keep_mask(seed, site, p, node, slot, np.arange(3)), philox.scale(p), np.float32(0))


def _expected_two_cells(forest: Forest, x: np.ndarray, b: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """A's and B's results from the contract's formula alone, one node at a time."""
    h: dict[int, np.ndarray] = {}
    g: dict[int, np.ndarray] = {}
    for n in forest.level_order.tolist():
        kids = [int(k) for k in forest.children(n)]
        if kids:
            v = x[n] * _scaled_mask(seed, 1, 0.5, n, 0) + b * _scaled_mask(seed, 3, 0.75, n, 0)
            for i, k in enumerate(kids):
                v = v + h[k] * _scaled_mask(seed, 2, 0.75, n, 1 + i)
            h[n] = v
        else:
            h[n] = x[n] * _scaled_mask(seed, 0, 0.5, n, 0)
        g[n] = x[n] * _scaled_mask(seed, 0, 0.5, n, 0) + sum((g[k] for k in kids), np.zeros(3, np.float32))
    states = np.stack([h[n] for n in range(forest.num_nodes)])
    return {
        "A.h": states,
        "A.y": np.stack([states[r] * _scaled_mask(seed, 4, 1 / 3, int(r), 0) for r in forest.roots]),
        "A.z": np.stack([states[n] * 2 * _scaled_mask(seed, 5, 0.5, n, 0) for n in range(forest.num_nodes)]),
        "B.h": np.stack([g[n] for n in range(forest.num_nodes)]),
    }


@pytest.mark.parametrize("device", ["interp", "cpu", pytest.param("cuda-emu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("seed", [0, 2**32 - 1, 2**32, 2**32 + 5, 2**64 - 1, "random"])
def test_sites_count_per_cell_across_leaf_node_and_outputs(two_cells, device, seed, rng):
    """The contract's sites, node ids (an `at root` output's n is the root's id) and key words (seeds at the
    2^32 boundary: low word 0 or all ones), bitwise against `keep_mask`."""
    seed = int(rng.integers(0, 2**64, dtype=np.uint64)) if seed == "random" else seed
    forest = Forest.concat([Forest.random(4, rng, max_children=3, max_nodes=9), Forest.from_nested([[]])])
    x = np.exp2(rng.integers(-2, 3, (forest.num_nodes, 3))).astype(np.float32)
    a, b = two_cells.A(device=device), two_cells.B(device=device)
    a.load_params({"b": np.exp2(rng.integers(-2, 3, 3)).astype(np.float32)})
    expected = _expected_two_cells(forest, x, a.params["b"], seed)
    out_a = a(forest, train=True, dropout_seed=seed, x=x)
    out_b = b(forest, train=True, dropout_seed=seed, x=x)
    got = {"A.h": out_a["h"], "A.y": out_a["y"], "A.z": out_a["z"], "B.h": out_b["h"]}
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"{device} {key}")
    assert (got["A.h"] == 0).any() and (got["A.h"] != 0).any()


# ------------------------------------------------------------------ the SST example trains the dropout cell
@pytest.mark.slow
def test_the_train_sst_example_trains_the_dropout_cell_in_training_mode(tmp_path, monkeypatch):
    """examples/train_sst.py --cell examples/treelstm_dropout.cell: before the fix it asked the module for
    `BinaryTreeLSTM` (an AttributeError) and its steps ran in evaluation mode (no dropout at all). Now every
    step is a training-mode call with a seed of its own and every evaluation an evaluation-mode one."""
    import importlib.util

    from tests.helpers import EXAMPLES, sst_path

    spec = importlib.util.spec_from_file_location("train_sst_example", EXAMPLES / "train_sst.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    calls: list[tuple[bool, int | None]] = []
    load = example.cortexc.load

    def recording_load(*args, **kwargs):
        module = load(*args, **kwargs)
        cls = module.DropoutTreeLSTM
        call = cls.__call__

        def recorded(self, forest, *a, **kw):
            out = call(self, forest, *a, **kw)
            calls.append((kw.get("train", False), out.dropout_seed))
            return out

        monkeypatch.setattr(cls, "__call__", recorded)
        return module

    monkeypatch.setattr(example.cortexc, "load", recording_load)
    small = ["--limit", "20", "--dev-limit", "10", "--epochs", "1", "--steps", "3", "--hidden", "4", "--embed", "3"]
    data = ["--train", str(sst_path("train")), "--dev", str(sst_path("dev")), "--batch", "5"]
    assert example.main([*small, *data, "--cell", str(EXAMPLES / "treelstm_dropout.cell")]) == 0
    steps = [seed for train, seed in calls if train]
    assert len(steps) == 3 and len(set(steps)) == 3 and all(isinstance(s, int) for s in steps)
    assert [seed for train, seed in calls if not train] and all(seed is None for train, seed in calls if not train)
