"""The CUDA target's host side (`cortexc.targets.cuda.host`), run through the emulator: what goes to and
from the device per call, arena reuse, and results kept for a backward while other calls run."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.targets.cuda.host import DeviceMemory, Layout
from tests.helpers import EXAMPLES, random_inputs, relative_error


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    return cortexc.load(EXAMPLES / "binary_treelstm.cell", out_dir=tmp_path_factory.mktemp("pkg"), X=6, H=5, V=30, C=3)


def _counting(monkeypatch) -> dict[str, int]:
    counts = {"alloc": 0, "upload": 0, "zero": 0, "download": 0}
    for name in counts:
        original = getattr(DeviceMemory, name)

        def counted(self, *args, _name=name, _original=original):
            counts[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(DeviceMemory, name, counted)
    return counts


@pytest.mark.slow
def test_one_upload_one_memset_one_download_per_call(module, rng, monkeypatch):
    model = module.BinaryTreeLSTM(device="cuda-emu", seed=0)
    reference = module.BinaryTreeLSTM(device="interp", seed=0)
    forest = Forest.random(6, rng=rng, binary=True, max_nodes=15)
    inputs = random_inputs(model.cell, forest, rng)
    for _ in range(2):  # builds, uploads the params, allocates the arenas a kept forward needs besides
        out = model(forest, grad=True, **inputs)
        model.backward(out, {"logits": np.ones_like(out["logits"])})
    counts = _counting(monkeypatch)
    for _ in range(3):
        out = model(forest, grad=True, **inputs)
        grads = model.backward(out, {"logits": np.ones_like(out["logits"])})
    assert counts == {"alloc": 0, "upload": 6, "zero": 6, "download": 6}  # arenas reused, no cudaMalloc
    expected = reference(forest, grad=True, **inputs)
    expected_grads = reference.backward(expected, {"logits": np.ones_like(expected["logits"])})
    for key in expected:
        assert relative_error(out[key], expected[key]) < 1e-5, key
    for key in expected_grads:
        assert relative_error(grads[key], expected_grads[key]) < 1e-5, key


def test_a_kept_forward_survives_other_calls_and_its_arena_comes_back(module, rng):
    model = module.BinaryTreeLSTM(device="cuda-emu", seed=1)
    reference = module.BinaryTreeLSTM(device="interp", seed=1)
    first = Forest.random(5, rng=rng, binary=True, max_nodes=13)
    second = Forest.random(9, rng=rng, binary=True, max_nodes=21)
    inputs_first = random_inputs(model.cell, first, rng)
    inputs_second = random_inputs(model.cell, second, rng)
    kept = model(first, grad=True, **inputs_first)
    model(second, **inputs_second)  # must not reuse the kept arena
    model(second, grad=True, **inputs_second)
    upstream = {"logits": rng.standard_normal(kept["logits"].shape).astype(np.float32)}
    grads = model.backward(kept, upstream)
    expected = reference.backward(reference(first, grad=True, **inputs_first), upstream)
    for key in expected:
        assert relative_error(grads[key], expected[key]) < 1e-5, key

    pool = model._executor_for_device().pool
    owned = len(pool.owned)
    del kept
    gc.collect()
    idle = len(pool.idle)
    model(first, **inputs_first)
    assert len(pool.owned) == owned and len(pool.idle) == idle  # the returned arena served this call


def test_params_reloaded_go_up_again(module, rng):
    model = module.BinaryTreeLSTM(device="cuda-emu", seed=2)
    forest = Forest.random(3, rng=rng, binary=True, max_nodes=9)
    inputs = random_inputs(model.cell, forest, rng)
    before = model(forest, **inputs)
    model.load_params({"W_s": np.zeros_like(model.params["W_s"]), "b_s": np.ones_like(model.params["b_s"])})
    after = model(forest, **inputs)
    assert np.array_equal(after["h"], before["h"])
    assert np.array_equal(after["logits"], np.ones_like(after["logits"]))


def test_empty_forest(module):
    model = module.BinaryTreeLSTM(device="cuda-emu", seed=0)
    out = model(Forest.from_parents([]), word=np.zeros(0, np.int32))
    assert out["h"].shape == (0, 5) and out["logits"].shape == (0, 3)


def test_layout_aligns_and_spans():
    layout = Layout()
    assert layout.place("a", 10) == 0
    assert layout.place("b", 0) == 256
    assert layout.place("c", 300) == 512
    assert layout.size == 1024
    assert layout.span("b", "c") == (256, 556)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
def test_load_params_while_forwards_run_gives_all_old_or_all_new(module, device, rng):
    """A forward running while another thread calls load_params sees one set of params whole: its results
    are bitwise those of the old params or of the new, never a mix (and never freed memory)."""
    import threading

    model = module.BinaryTreeLSTM(device=device, seed=0)
    old = dict(model.params)
    new = {name: (value + 0.05 * rng.standard_normal(value.shape)).astype(np.float32) for name, value in old.items()}
    sets = [old, new]
    forest = Forest.random(30, rng=rng, binary=True, max_nodes=61)
    inputs = random_inputs(model.cell, forest, rng)
    expected = []
    for params in sets:
        model.load_params(params)
        expected.append(model(forest, **inputs))
    assert not np.array_equal(expected[0]["logits"], expected[1]["logits"])
    # a mix tells itself apart: each param alone from the other set changes the logits
    for name in sets[0]:
        model.load_params({**sets[0], name: sets[1][name]})
        assert not np.array_equal(model(forest, **inputs)["logits"], expected[0]["logits"]), name
    model.load_params(sets[0])

    stop = threading.Event()
    loads = [0]

    def reload() -> None:
        while not stop.is_set():
            model.load_params(sets[loads[0] % 2])
            loads[0] += 1

    thread = threading.Thread(target=reload)
    thread.start()
    seen = set()
    try:
        # forwards until the other thread has loaded a few times (on a loaded machine it may get few turns)
        least = 40 if device == "cpu" else 12
        for count in range(20 * least):
            if count >= least and loads[0] > 5:
                break
            out = model(forest, **inputs)
            matches = [k for k in (0, 1) if all(np.array_equal(out[key], expected[k][key]) for key in out)]
            assert matches, f"a forward mixed old and new params (after {loads[0]} loads)"
            seen.update(matches)
    finally:
        stop.set()
        thread.join()
    assert loads[0] > 5
