"""The version 2 features (`[1]` broadcasting, `v[k]`, `child_softmax`, `dropout`) attacked as a new user
and a hostile tester would: each test here failed before the fix it names (see docs/architecture.md).

References: the interpreter (`cortexc.runtime.reference` through `device="interp"`) and, where the
contract states a formula, NumPy written here from the contract alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.cli import main

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


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
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
