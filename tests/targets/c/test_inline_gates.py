"""The gates of the direct node kernel (`Kernel.inline_gates`, the registry's `OpDef.c_inline`): sigmoid and
tanh without libm, as an inference of wide levels computes them. Through a compiled cell whose node values
are exactly the inputs (the stacked product's weights are zero), on chains wide enough for the direct kernel:
their error against float64 over every range a gate sees, their exact values at saturation, NaN, small
arguments; and that the training forward (the saving kernel) still computes libmvec's gates."""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from tests.targets.c.test_fastmath import _ulps

H = 128  # the stacked product has K = 2 H: within Target.direct_max_k
CHAINS = 64  # rows per level: far above the direct kernel's threshold
LENGTH = 9

#: bounds over the largest errors measured (Zen 4, 16 lanes): tanh 5.1 ulps on the clamped range, sigmoid
#: (1 + tanh(x / 2)) / 2 1.0e-7 absolutely
MAX_TANH_ULPS = 8.0
MAX_SIGMOID_ERROR = 2e-7

CELL = (
    f"cell G on tree(arity = 1) {{ dim H = {H} input x[H], y[H] param P[H, H], Q[H, H] state s[H], t[H], z[H]"
    " node { g = P @ child[0].z + Q @ y + x  s = sigmoid(g)  t = tanh(g)  z = y } }"
)
#: the node's gates are of exactly x: the stacked product is 0 (zero weights, and y = z = 0: never 0 * inf)


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    out = tmp_path_factory.mktemp("inline_gates")
    path = out / "gates.cell"
    path.write_text(CELL, encoding="utf-8")
    model = cortexc.load(path, out_dir=out / "pkg").G(device="cpu")
    model.load_params({"P": np.zeros((H, H), np.float32), "Q": np.zeros((H, H), np.float32)})
    assert "cx_tanh_inline(" in type(model)._kernel_sources["c"]
    model._executor_for_device().direct = 2  # the direct kernel whatever the forest (it is wide anyway)
    return model


def _chains() -> Forest:
    one = Forest.from_parents(np.append(np.arange(1, LENGTH), -1))
    return Forest.concat([one] * CHAINS)


def _run(gates, x: np.ndarray, grad: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The gates of `x` (one row per node) at the internal nodes only (the leaves run the leaf kernel), and
    which nodes those are."""
    forest = _chains()
    out = gates(forest, grad=grad, x=x, y=np.zeros_like(x))
    internal = np.asarray(forest.num_children) > 0
    return {name: out[name][internal] for name in ("s", "t")}, internal


def _inputs(rng: np.random.Generator, lo: float, hi: float) -> np.ndarray:
    x = rng.uniform(lo, hi, (CHAINS * LENGTH, H)).astype(np.float32)
    x[1] = np.linspace(lo, hi, H, dtype=np.float32)  # the ends of the range, and evenly between them
    return x


@pytest.mark.parametrize("lo, hi", [(-20.0, -9.0), (-9.0, -0.625), (-0.625, 0.625), (0.625, 9.0), (9.0, 90.0)])
def test_inline_gates_are_close_to_float64(gates, lo, hi, rng):
    x = _inputs(rng, lo, hi)
    out, internal = _run(gates, x)
    x64 = x[internal].astype(np.float64)
    assert float(_ulps(out["t"], np.tanh(x64)).max()) <= MAX_TANH_ULPS
    assert float(np.abs(out["s"] - 1.0 / (1.0 + np.exp(-x64))).max()) <= MAX_SIGMOID_ERROR


def test_inline_gates_saturate_exactly_and_pass_nan(gates):
    special = np.array([np.inf, -np.inf, 100, -100, 1e30, -1e30, 18.1, -18.1, 9.5, -9.5, 0, -0.0, np.nan], np.float32)
    x = np.zeros((CHAINS * LENGTH, H), np.float32)
    x[:, : special.size] = special  # every row: scalar remainders and vector lanes alike
    out, _ = _run(gates, x)
    with np.errstate(over="ignore"):
        tanh = np.tanh(special.astype(np.float64)).astype(np.float32)
    for row in (0, 5, len(out["t"]) - 1):
        t, s = out["t"][row, : special.size], out["s"][row, : special.size]
        np.testing.assert_array_equal(t, tanh)  # +-1 beyond 9.01 as float32's tanh (from 7.9), 0, NaN
        np.testing.assert_array_equal(s[:-1], [1, 0, 1, 0, 1, 0, 1, 0, s[8], s[9], 0.5, 0.5])
        assert np.isnan(s[-1])


def test_inline_tanh_keeps_relative_accuracy_near_zero(gates):
    x = np.geomspace(1e-30, 0.5, CHAINS * LENGTH * H).astype(np.float32).reshape(CHAINS * LENGTH, H)
    x[1::2] *= -1
    out, internal = _run(gates, x)
    expected = np.tanh(x[internal].astype(np.float64))
    assert float((np.abs(out["t"] - expected) / np.abs(expected)).max()) < 1e-6


def test_the_training_forward_keeps_libmvecs_gates(gates, rng):
    """A forward for a backward runs the saving kernel, whose gates are libm's (within 2 ulps of float64
    near saturation, where the inline tanh is not): the two forwards' tanh differ in their last bits."""
    x = _inputs(rng, 3.0, 9.0)
    inference, internal = _run(gates, x)
    training, _ = _run(gates, x, grad=True)
    assert float(_ulps(training["t"], np.tanh(x[internal].astype(np.float64))).max()) <= 2.0
    assert not np.array_equal(inference["t"], training["t"])
    np.testing.assert_allclose(inference["t"], training["t"], rtol=1e-6, atol=0)
