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
