"""The gates (sigmoid, tanh, silu) as the C target computes them: through a compiled cell with the
package's flags (-O3 -march=native -mprefer-vector-width=512 -ffast-math: vectorised, libmvec's expf and
tanhf, rcp + Newton divisions), their error in float32 ulps against float64 over every range a gate sees, their
exact values at saturation, and NaN. (Inline polynomial exps were tried, session 8: at most 2-6% faster, and a
rational tanh within 4 ulps broke a stress cell's weight gradient: see the saturation test. The direct node
kernel, an inference's, whose values no gradient reads, has such gates: tests/targets/c/test_inline_gates.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest

H = 1024
NODES = 256

#: bounds over the largest errors measured on 26M random inputs per function: sigmoid 4.6, silu 5.3 (Zen 3,
#: AVX2) and 4.5, 5.6 (Sapphire Rapids, 16 lanes; the rcp + Newton division of 1 / (1 + e) is most of it);
#: tanh 1.0 and 1.37 (libmvec's tanhf, 8 and 16 lanes)
MAX_ULPS = {"sigmoid": 6.0, "tanh": 2.0, "silu": 7.0}


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    out = tmp_path_factory.mktemp("fastmath")
    path = out / "gates.cell"
    path.write_text(
        f"cell G on tree {{ dim H = {H} input x[H] state s[H], t[H], u[H]"
        " node { s = sigmoid(x) t = tanh(x) u = silu(x) } }",
        encoding="utf-8",
    )
    module = cortexc.load(path, out_dir=out / "pkg")
    return module.G(device="cpu")


def _reference(name: str, x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    sigmoid = 1.0 / (1.0 + np.exp(-x64))
    return {"sigmoid": sigmoid, "tanh": np.tanh(x64), "silu": x64 * sigmoid}[name]


def _ulps(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """|got - expected| in units of float32's spacing at the expected value; values below float32's smallest
    normal (which fast-math flushes to 0) count as 0 when got is within that distance."""
    tiny = np.abs(expected) < np.finfo(np.float32).tiny
    # float32's spacing, in float64: the library's fast-math start-up flushes float32 subnormals process-wide
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(expected), 2.0**-126))) - 23)
    error = np.abs(got.astype(np.float64) - expected) / spacing
    return np.where(tiny & (np.abs(got) <= np.finfo(np.float32).tiny), 0.0, error)


@pytest.mark.parametrize("lo, hi", [(-87.0, -9.0), (-9.0, -0.625), (-0.625, 0.625), (0.625, 9.0), (9.0, 90.0)])
def test_gates_are_within_a_few_ulps_of_float64(gates, lo, hi, rng):
    x = rng.uniform(lo, hi, (NODES, H)).astype(np.float32)
    x[0] = np.linspace(lo, hi, H, dtype=np.float32)  # the ends of the range, and evenly between them
    out = gates(Forest.from_parents([-1] * NODES), x=x)
    for name, state in (("sigmoid", "s"), ("tanh", "t"), ("silu", "u")):
        worst = float(_ulps(out[state], _reference(name, x)).max())
        assert worst <= MAX_ULPS[name], f"{name} on [{lo}, {hi}]: {worst:.2f} ulps"


def test_tanh_near_saturation_is_within_an_ulp(gates, rng):
    """Where tanh is within 1e-3 of 1, its derivative 1 - tanh^2 is a difference of nearly equal numbers: an
    ulp of tanh is 1e-4 of it at x = 5 and 10% at x = 8. So tanh must be within an ulp there, as float32's own
    rounding is within half of one (a rational approximation within 4 ulps gave a stress cell's weight
    gradient 10x libmvec's error). libmvec's 16-lane tanhf rounds 41% of them the other way, its 8-lane one
    1.4%: each within the ulp."""
    x = rng.uniform(3.0, 10.0, (NODES, H)).astype(np.float32)
    x[1::2] *= -1
    out = gates(Forest.from_parents([-1] * NODES), x=x)
    assert float(_ulps(out["t"], np.tanh(x.astype(np.float64))).max()) <= 1.0
    saturated = np.abs(x) >= np.float32(9.010914)  # float32's tanh is +-1 from here: so is the compiled one
    assert (out["t"][saturated] == np.sign(x[saturated])).all()
    assert (np.abs(out["t"][~saturated]) < 1).all()


def test_small_arguments_keep_their_relative_accuracy(gates):
    """tanh(x) ~ x and silu(x) ~ x / 2 near 0: relative, not absolute, accuracy (no 1 - 2 / (e + 1))."""
    x = np.geomspace(1e-30, 0.5, NODES * H).astype(np.float32).reshape(NODES, H)
    x[1::2] *= -1
    out = gates(Forest.from_parents([-1] * NODES), x=x)
    for name, state in (("tanh", "t"), ("silu", "u")):
        expected = _reference(name, x)
        relative = np.abs(out[state] - expected) / np.abs(expected)
        assert float(relative.max()) < 1e-6, name


def test_saturated_and_special_values_are_exact(gates):
    x = np.zeros((NODES, H), np.float32)
    special = np.array([np.inf, -np.inf, 100, -100, 1e30, -1e30, 88.8, -88.8, 9.5, -9.5, 0, -0.0], np.float32)
    x[:, : special.size] = special  # every row: scalar remainders and vector lanes alike
    x[1] = -100
    x[2] = 100
    out = gates(Forest.from_parents([-1] * NODES), x=x)
    with np.errstate(over="ignore", invalid="ignore"):
        sigmoid = (1.0 / (1.0 + np.exp(-special.astype(np.float64)))).astype(np.float32)
    tanh = np.tanh(special.astype(np.float64)).astype(np.float32)
    sigmoid[np.abs(sigmoid) < np.finfo(np.float32).tiny] = 0  # exp below float32's normals is flushed to 0
    for row in (0, 7, NODES - 1):
        np.testing.assert_array_equal(out["t"][row, : special.size], tanh)  # +-1 beyond 9, as float32's tanh
        np.testing.assert_array_equal(out["s"][row, : special.size][special > 20], 1.0)
        np.testing.assert_allclose(out["s"][row, : special.size], sigmoid, rtol=1e-6, atol=0)
    assert (out["s"][1] == 0).all() and (out["s"][2] == 1).all()
    assert (out["t"][1] == -1).all() and (out["t"][2] == 1).all() and (out["u"][2] == 100).all()


def test_below_exps_range_the_gates_are_zero_or_tiny(gates, rng):
    """exp(x) below -87.34 is a subnormal, flushed to 0 (fast-math's start-up makes every float32 op of the
    process do so): sigmoid is 0 there, and silu at most 1e-35."""
    x = rng.uniform(-1e4, -87.34, (NODES, H)).astype(np.float32)
    out = gates(Forest.from_parents([-1] * NODES), x=x)
    assert (out["s"] == 0).all() and (np.abs(out["u"]) <= 1e-35).all()
    assert (out["t"] == -1).all()


def test_nan_passes_through(gates):
    x = np.full((NODES, H), np.nan, np.float32)
    out = gates(Forest.from_parents([-1] * NODES), x=x)
    for state in ("s", "t", "u"):
        assert np.isnan(out[state]).all(), state
