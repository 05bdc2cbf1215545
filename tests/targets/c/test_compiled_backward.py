"""The compiled backward (device="cpu") against the interpreter's backward, for every spec example."""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from tests.helpers import EXAMPLES, load_example, random_inputs, small_forest

DIMS = {"X": 9, "H": 7, "V": 20, "C": 3}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.cell")), ids=lambda p: p.stem)
def test_compiled_gradients_match_the_interpreter(path, rng, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    module = load_example(path, DIMS, tmp_path_factory.mktemp("pkg"))
    cls = getattr(module, module.__all__[0])
    compiled, reference = cls(device="cpu", seed=3), cls(device="interp", seed=3)
    params = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in compiled.params.items()}
    compiled.load_params(params)
    reference.load_params(params)
    forest = small_forest(compiled.cell, rng, 6, 15, chains=(6, 3, 1), dag_nodes=40)
    inputs = random_inputs(compiled.cell, forest, rng)
    out_c = compiled(forest, grad=True, **inputs)
    out_r = reference(forest, grad=True, **inputs)
    upstream = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in out_r.items()}
    grads_c = compiled.backward(out_c, upstream)
    grads_r = reference.backward(out_r, upstream)
    assert set(grads_c) == set(grads_r)
    for name, expected in grads_r.items():
        error = np.abs(grads_c[name] - expected).max() / (np.abs(expected).max() + 1e-30)
        assert error < 1e-5, f"d{name}: relative error {error:.2e}"


def test_only_some_upstream_gradients(rng, tmp_path_factory, monkeypatch):
    """An output without an upstream gradient contributes nothing (its gradient kernel is skipped)."""
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", out_dir=tmp_path_factory.mktemp("pkg"), **DIMS)
    compiled = module.BinaryTreeLSTM(device="cpu", seed=1)
    reference = module.BinaryTreeLSTM(device="interp", seed=1)
    forest = Forest.random(5, rng=rng, binary=True)
    inputs = random_inputs(compiled.cell, forest, rng)
    out_c, out_r = compiled(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    upstream = {"h": rng.standard_normal(out_r["h"].shape).astype(np.float32)}
    grads_c, grads_r = compiled.backward(out_c, upstream), reference.backward(out_r, upstream)
    assert not grads_c["W_s"].any() and not grads_c["b_s"].any()
    for name, expected in grads_r.items():
        assert np.allclose(grads_c[name], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


CHAIN = """
cell Chain on tree {
    dim X = 3, H = 4
    input x[X]
    param W[H, X], U[H, H]
    state h[H]
    node { h = tanh(W @ x + sum(U @ child.h)) }
}
"""


@pytest.fixture(scope="module")
def chain_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain") / "chain.cell"
    path.write_text(CHAIN, encoding="utf-8")
    return path


@pytest.mark.parametrize("device", ["cpu", "interp"])
def test_backward_takes_only_the_result_of_the_model_that_made_it(device, chain_module, tmp_path, rng):
    """Another model's saved state has another layout (here: other dims): reading it would be out of bounds."""
    small = cortexc.load(chain_module, out_dir=tmp_path / "small").Chain(device=device)
    twin = cortexc.load(chain_module, out_dir=tmp_path / "small").Chain(device=device)
    wide = cortexc.load(chain_module, out_dir=tmp_path / "wide", H=40).Chain(device=device)
    forest = Forest.from_parents([-1, *range(199)])  # a chain: the backward walks every saved row
    inputs = random_inputs(wide.cell, forest, rng)
    out = wide(forest, grad=True, **inputs)
    upstream = {"h": np.ones((forest.num_nodes, 4), np.float32)}
    for other in (small, twin):
        with pytest.raises(cortexc.InputError, match="result of another model"):
            other.backward(out, upstream)
    own = twin(forest, grad=True, **inputs)
    with pytest.raises(cortexc.InputError, match="result of another model"):
        small.backward(own, upstream)
    assert set(twin.backward(own, upstream)) == {"W", "U", "x"}


@pytest.mark.parametrize("device", ["cpu", "interp"])
def test_editing_results_or_inputs_does_not_change_the_backward(device, chain_module, tmp_path, rng):
    model = cortexc.load(chain_module, out_dir=tmp_path).Chain(device=device, seed=2)
    forest = Forest.random(6, rng=rng, max_children=3)
    inputs = random_inputs(model.cell, forest, rng)
    upstream = {"h": rng.standard_normal((forest.num_nodes, 4)).astype(np.float32)}
    out = model(forest, grad=True, **inputs)
    before = model.backward(out, upstream)
    out["h"] *= 0
    inputs["x"] *= 0
    after = model.backward(out, upstream)
    for name, expected in before.items():
        assert np.array_equal(after[name], expected), name


def test_load_params_during_a_call_neither_mixes_nor_frees_the_weights_in_use(chain_module, tmp_path, rng):
    """ctypes lets go of the GIL: another thread may call load_params while the C code runs. The call keeps
    the weights it started with alive and whole (seen here from inside the call, deterministically)."""
    import gc
    import weakref

    model = cortexc.load(chain_module, out_dir=tmp_path).Chain(device="cpu", seed=1)
    forest = Forest.random(5, rng=rng, max_children=3)
    inputs = random_inputs(model.cell, forest, rng)
    expected = model(forest, **inputs)["h"]
    executor = model._executor_for_device()
    in_use = [weakref.ref(array) for arrays in executor._weights for array in arrays]
    launch = executor._launch_forward
    swapped = {k: np.zeros_like(v) for k, v in model.params.items()}

    def load_params_midway(call, lin):
        model.load_params(swapped)  # what the other thread does
        gc.collect()
        assert all(ref() is not None for ref in in_use), "the weights of the running call were freed"
        launch(call, lin)

    executor._launch_forward = load_params_midway
    np.testing.assert_array_equal(model(forest, **inputs)["h"], expected)
    executor._launch_forward = launch
    assert not model(forest, **inputs)["h"].any()  # the next call has the new params (all zero: tanh(0))
