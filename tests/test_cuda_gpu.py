"""device="cuda" on a real GPU against the reference interpreter (device="interp").

Skipped unless PyCUDA imports and finds a GPU; with ``CORTEXC_REQUIRE_GPU=1`` (set by
scripts/gpu_check.sh on the GPU machine) a missing PyCUDA, GPU or SST file fails instead.

- every ``examples/*.cell`` in every launch mode at small dims (and at middling dims, for more than one GEMM
  panel and tile), on random forests: forward within 1e-5 and backward within 1e-4 of the interpreter
  (normwise relative error: max |gpu - ref| / max |ref|);
- the binary Tree-LSTM at H = 256 on SST dev trees (``$CORTEXC_SST_DIR`` or ``.gpu/sst`` or
  ``../shared/data/sst``): forward on 100 trees, backward on 20, against the interpreter.

``CORTEXC_GPU_TEST_DEVICE`` runs the same checks on another device (``cuda-emu``, ``cpu``): a way to test this
file without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.runtime.vocab import Vocab
from tests.helpers import EXAMPLES, REPO, random_inputs

DEVICE = os.environ.get("CORTEXC_GPU_TEST_DEVICE", "cuda")
REQUIRE_GPU = os.environ.get("CORTEXC_REQUIRE_GPU") == "1"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.cell"))
DIMS = {
    "small": {"X": 9, "H": 7, "V": 20, "C": 3},
    "mid": {"X": 40, "H": 33, "V": 50, "C": 5},
}
FORWARD_RTOL = 1e-5
BACKWARD_RTOL = 1e-4
SST_HIDDEN = 256
SST_FORWARD_TREES = 100
SST_BACKWARD_TREES = 20


def _no_gpu_reason() -> str | None:
    """Why device="cuda" cannot run here, or None."""
    if DEVICE != "cuda":
        return None
    try:
        import pycuda.driver as driver
    except ImportError as err:
        return f"PyCUDA is not importable ({err})"
    try:
        driver.init()
        count = driver.Device.count()
    except Exception as err:  # PyCUDA's own error types: no driver, no device
        return f"no usable CUDA driver ({type(err).__name__}: {err})"
    return None if count else "the CUDA driver sees no GPU"


_REASON = _no_gpu_reason()
if _REASON is not None:
    if REQUIRE_GPU:
        pytest.fail(f"CORTEXC_REQUIRE_GPU=1 but {_REASON}", pytrace=False)
    pytest.skip(f"device='cuda' needs a GPU: {_REASON}", allow_module_level=True)


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.size == 0:
        return 0.0
    return float(np.abs(actual - expected).max() / (np.abs(expected).max() + 1e-30))


def _forest(cell, rng: np.random.Generator) -> Forest:
    """A forest the cell accepts, with more rows per level than one tile and nodes missing arity children."""
    if cell.structure.shares_children:
        return Forest.random_dag(200, rng=rng)
    if cell.arity == 1:
        chain = [7, 2, 1, 40, 17]
        return Forest.concat([Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)]) for n in chain])
    return Forest.random(40, rng=rng, binary=cell.arity == 2, max_children=cell.arity or 5, max_nodes=30)


@pytest.fixture(scope="module")
def packages():
    """Every example compiled once per dims set (into $CORTEXC_CACHE, shared with the benchmark)."""
    built = {}
    for size, dims in DIMS.items():
        for path in EXAMPLE_FILES:
            declared = dict(cortexc.compile_file(path)[0].dims)
            built[size, path.stem] = cortexc.load(path, **{k: v for k, v in dims.items() if k in declared})
    return built


@pytest.mark.parametrize("mode", ["split", "persistent", "levels"])
@pytest.mark.parametrize("size", list(DIMS))
@pytest.mark.parametrize("name", [p.stem for p in EXAMPLE_FILES])
def test_cuda_matches_the_interpreter(packages, name, size, mode, rng, monkeypatch):
    """Every launch mode (CORTEXC_CUDA_MODE): split levels by columns with weights in shared memory (the
    default), the persistent kernel by row tiles only, one grid per level."""
    monkeypatch.setenv("CORTEXC_CUDA_MODE", mode)
    module = packages[size, name]
    cls = getattr(module, module.__all__[0])
    gpu, reference = cls(device=DEVICE, seed=2), cls(device="interp", seed=2)
    params = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in reference.params.items()}
    gpu.load_params(params)
    reference.load_params(params)
    forest = _forest(reference.cell, rng)
    inputs = random_inputs(reference.cell, forest, rng)
    out_g, out_r = gpu(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    assert set(out_g) == set(out_r)
    errors = {key: _relative(out_g[key], expected) for key, expected in out_r.items()}
    print(f"{name}/{size}: {forest.num_nodes} nodes, {forest.num_levels} levels; forward rel err", errors)
    assert max(errors.values()) < FORWARD_RTOL, errors
    upstream = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in out_r.items()}
    grads_g, grads_r = gpu.backward(out_g, upstream), reference.backward(out_r, upstream)
    assert set(grads_g) == set(grads_r)
    errors = {f"d{key}": _relative(grads_g[key], expected) for key, expected in grads_r.items()}
    print(f"{name}/{size}: backward rel err", errors)
    assert max(errors.values()) < BACKWARD_RTOL, errors


# ------------------------------------------------------------------ SST


def _sst_dev() -> Path:
    candidates = [Path(os.environ["CORTEXC_SST_DIR"])] if os.environ.get("CORTEXC_SST_DIR") else []
    candidates += [REPO / ".gpu" / "sst", REPO.parent / "shared" / "data" / "sst"]
    for directory in candidates:
        if (directory / "dev.txt").is_file():
            return directory / "dev.txt"
    reason = f"SST dev trees not found (looked in {', '.join(map(str, candidates))}; set CORTEXC_SST_DIR)"
    if REQUIRE_GPU:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def sst():
    """The dev lines, their vocabulary and the H=256 binary Tree-LSTM on the GPU and in the interpreter."""
    with open(_sst_dev(), encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    vocab = Vocab.build([Forest.from_ptb(lines)])
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", H=SST_HIDDEN)  # V: the cell's 21701 (same as bench)
    gpu = module.BinaryTreeLSTM(device=DEVICE, seed=0)
    reference = module.BinaryTreeLSTM(device="interp", seed=0)
    assert len(vocab) <= gpu.params["E"].shape[0]
    return lines, vocab, gpu, reference


@pytest.mark.parametrize("mode", ["split", "persistent", "levels"])
def test_binary_treelstm_forward_on_sst_dev(sst, mode, monkeypatch):
    monkeypatch.setenv("CORTEXC_CUDA_MODE", mode)
    lines, vocab, gpu, reference = sst
    forest = Forest.from_ptb(lines[:SST_FORWARD_TREES])
    ids = vocab.encode(forest)
    out_g, out_r = gpu(forest, word=ids), reference(forest, word=ids)
    errors = {key: _relative(out_g[key], expected) for key, expected in out_r.items()}
    print(
        f"SST dev, {SST_FORWARD_TREES} trees, {forest.num_nodes} nodes, {forest.num_levels} levels, "
        f"H={SST_HIDDEN}, mode {mode}: forward rel err",
        errors,
    )
    assert max(errors.values()) < FORWARD_RTOL, errors
    again = gpu(forest, word=ids)  # params stay on the device; a second call gives the same result
    assert max(_relative(again[key], out_g[key]) for key in out_g) < 1e-6


def test_binary_treelstm_backward_on_sst_dev(sst, rng):
    lines, vocab, gpu, reference = sst
    forest = Forest.from_ptb(lines[:SST_BACKWARD_TREES])
    ids = vocab.encode(forest)
    out_g, out_r = gpu(forest, grad=True, word=ids), reference(forest, grad=True, word=ids)
    upstream = {"logits": rng.standard_normal(out_r["logits"].shape).astype(np.float32)}
    grads_g, grads_r = gpu.backward(out_g, upstream), reference.backward(out_r, upstream)
    assert set(grads_g) == set(grads_r)
    errors = {f"d{key}": _relative(grads_g[key], expected) for key, expected in grads_r.items()}
    print(f"SST dev, {SST_BACKWARD_TREES} trees, H={SST_HIDDEN}: backward rel err", errors)
    assert max(errors.values()) < BACKWARD_RTOL, errors


def test_results_can_stay_on_the_gpu(packages, rng):
    """host=False: on device="cuda" the states and outputs come back as GPUArrays (no copy to the host);
    they hold what the host copy holds."""
    module = packages["small", "treelstm"]
    gpu = module.ChildSumTreeLSTM(device=DEVICE, seed=1)
    forest = _forest(gpu.cell, rng)
    inputs = random_inputs(gpu.cell, forest, rng)
    on_host, kept = gpu(forest, **inputs), gpu(forest, host=False, **inputs)
    assert set(kept) == set(on_host)
    for key, expected in on_host.items():
        value = kept[key]
        if DEVICE == "cuda":
            from pycuda.gpuarray import GPUArray

            assert isinstance(value, GPUArray), key
            value = value.get()
        assert value.shape == expected.shape and np.array_equal(value, expected), key
