"""Windowed hoisting (`Target.hoist_window_bytes`, the C driver's `cx_window_end`): an inference computes the
hoisted rows a window of levels at a time, into a buffer that stays in cache, instead of all of them before
the recursion; so does a training forward whose backward reads no hoisted row. Their results must be bitwise
those of the forward that hoists every row (a window as large as the internal nodes) whatever the window, at
any thread count, and match the interpreter; a window smaller than a level is refused, never overrun."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.codegen.target import TARGETS
from cortexc.errors import CortexcError
from cortexc.runtime.linearize import linearize
from cortexc.targets.c.executor import CpuExecutor
from tests.helpers import EXAMPLES, REPO, assert_saturated_close, random_inputs, relative_error, twin_models
from tests.helpers import digest as _digest

#: cells with hoisted input projections: a chain LSTM, a child-sum Tree-LSTM (two hoisted arrays)
CELLS = {"lstm": ("lstm.cell", {"X": 7, "H": 9}), "treelstm": ("treelstm.cell", {"X": 6, "H": 8})}


@pytest.fixture(autouse=True)
def _hoisted_node_kernel(monkeypatch):
    """Windows are the hoisted kernel's: these forests' wide levels would run the direct one (`passes.direct`)."""
    monkeypatch.setattr(CpuExecutor, "direct", 1)


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return {key: cortexc.load(EXAMPLES / f, tmp_path_factory.mktemp(key), **dims) for key, (f, dims) in CELLS.items()}


def _chain(n: int) -> Forest:
    return Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)])


def _star(n: int) -> Forest:
    return Forest.from_parents([n - 1] * (n - 1) + [-1])


def _mixed_forest(key: str, rng: np.random.Generator) -> Forest:
    """Levels of one row (a long chain) next to levels of hundreds (short chains, a wide tree)."""
    if key == "lstm":
        return Forest.concat([_chain(300)] + [_chain(int(n)) for n in rng.integers(2, 7, 300)])
    return Forest.concat([_star(40), _chain(90), Forest.random(120, rng=rng, max_nodes=25), _star(3)])


def _executor(model):
    return model._executor_for_device()


@pytest.mark.parametrize("key", list(CELLS))
def test_the_package_asks_for_a_window_of_the_target_s_bytes(key, modules):
    """The window's rows follow from the C target's budget and the hoisted widths; CUDA hoists every row."""
    model = getattr(modules[key], modules[key].__all__[0])(device="cpu")
    executor = _executor(model)
    floats = sum(executor.spec.hoisted_widths)
    assert floats > 0
    assert executor.section.hoisted_window_rows == TARGETS["c"].hoist_window_bytes // (4 * floats) > 0
    assert TARGETS["cuda"].hoist_window_bytes == 0


@pytest.mark.parametrize("key", list(CELLS))
@pytest.mark.parametrize("window", [1, 3, 8, 64, None])
def test_any_window_gives_the_results_of_hoisting_every_row(key, window, modules, rng, monkeypatch):
    """Window sizes from one level (1: each window is the widest level, so a wide level is one window of
    its own) to many levels, on forests whose levels range from 1 to hundreds of rows: the inference equals,
    bit for bit, the same model with windowing off, and it matches the interpreter, as does a training forward
    (in kernels that also keep the gates: `passes.saving`)."""
    model, reference = twin_models(modules[key], "cpu", int(rng.integers(0, 2**31)), rng)
    forest = _mixed_forest(key, rng)
    if window is None:  # the package's own window (thousands of rows at these widths): a larger forest
        forest = Forest.concat([forest] + [_chain(500)] * 10)
    inputs = random_inputs(model.cell, forest, rng)
    executor = _executor(model)
    if window is not None:
        monkeypatch.setattr(executor, "section", dataclasses.replace(executor.section, hoisted_window_rows=window))
    lin = linearize(forest)
    rows = executor.hoisted_window_rows(lin)
    internal = lin.num_nodes - lin.num_leaves
    assert lin.widest_internal_level <= rows < internal  # windowed: fewer rows than internal nodes
    windowed = model(forest, **inputs)
    kept = model(forest, grad=True, **inputs)
    monkeypatch.setattr(executor, "section", dataclasses.replace(executor.section, hoisted_window_rows=0))
    assert executor.hoisted_window_rows(lin) == internal
    whole = model(forest, **inputs)
    assert _digest(windowed) == _digest(whole)
    expected = reference(forest, **inputs)
    for name, value in expected.items():
        assert relative_error(windowed[name], value) < 1e-5, name
        assert relative_error(kept[name], value) < 1e-5, name


@pytest.mark.parametrize("key", list(CELLS))
@pytest.mark.parametrize("window", [1, 8, None])
def test_a_training_forward_windows_where_its_backward_reads_no_hoisted_row(key, window, modules, rng, monkeypatch):
    """The chain LSTM's gradient kernels read what its forward saved, never a hoisted row: its training forward
    hoists a window of levels at a time too and keeps no hoisted rows for the backward. The child-sum
    Tree-LSTM's backward reads them, so its training forward hoists and keeps every row. Either way the
    results and the gradients are bitwise those of hoisting every row, and match the interpreter."""
    model, reference = twin_models(modules[key], "cpu", int(rng.integers(0, 2**31)), rng)
    executor = _executor(model)
    assert executor.section.training_window == (key == "lstm")
    forest = _mixed_forest(key, rng)
    if window is None:
        forest = Forest.concat([forest] + [_chain(500)] * 10)
    else:
        monkeypatch.setattr(executor, "section", dataclasses.replace(executor.section, hoisted_window_rows=window))
    lin = linearize(forest)
    internal = lin.num_nodes - lin.num_leaves
    assert executor.hoisted_window_rows(lin) < internal
    inputs = random_inputs(model.cell, forest, rng)
    out = model(forest, grad=True, **inputs)
    kept = out.saved[3]
    assert [h.shape[0] for h in kept.hoisted] == ([] if key == "lstm" else [internal] * 2)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items()}
    grads = model.backward(out, upstream)
    monkeypatch.setattr(
        executor, "section", dataclasses.replace(executor.section, training_window=False)
    )  # every row hoisted and kept
    whole = model(forest, grad=True, **inputs)
    assert [h.shape[0] for h in whole.saved[3].hoisted] == [internal] * len(executor.spec.hoisted_widths)
    assert _digest(dict(out)) == _digest(dict(whole))
    assert _digest(grads) == _digest(model.backward(whole, upstream))
    expected = reference(forest, grad=True, **inputs)
    for name, value in expected.items():
        assert relative_error(out[name], value) < 1e-5, name
    expected_grads = reference.backward(expected, upstream)
    for name, value in expected_grads.items():
        assert relative_error(grads[name], value) < 1e-5, name


def test_saturated_inputs_agree_with_the_interpreter_through_windows(modules, rng, monkeypatch):
    """Inputs of +-100 and inf saturate every gate; the windowed inference gives the whole inference's bits and
    matches the interpreter (`assert_saturated_close`: a chain of 50 steps sums its rounding, and one seed in
    many put an element 1.4e-5 relative off, with the normwise error at 5e-7)."""
    model, reference = twin_models(modules["lstm"], "cpu", 3, rng)
    forest = Forest.concat([_chain(50)] + [_chain(int(n)) for n in rng.integers(2, 9, 40)])
    x = rng.choice(np.array([-100.0, 100.0, np.inf, -np.inf, 0.5], np.float32), (forest.num_nodes, 7))
    whole = model(forest, x=x)
    monkeypatch.setattr(
        _executor(model), "section", dataclasses.replace(_executor(model).section, hoisted_window_rows=5)
    )
    got, expected = model(forest, x=x), reference(forest, x=x)
    assert _digest(dict(got)) == _digest(dict(whole))
    for name, value in expected.items():
        assert_saturated_close(got[name], value, name)


def test_a_window_smaller_than_a_level_is_refused(modules, rng, monkeypatch):
    """The C driver checks that every level fits before it writes a row: too small a window is a typed error
    (the runtime never sizes one so), not a write past the buffer."""
    model = getattr(modules["lstm"], modules["lstm"].__all__[0])(device="cpu", seed=1)
    forest = Forest.concat([_chain(4)] * 30)  # levels of 30 rows
    executor = _executor(model)
    monkeypatch.setattr(executor, "hoisted_window_rows", lambda lin: 29)
    x = rng.standard_normal((forest.num_nodes, 7)).astype(np.float32)
    with pytest.raises(CortexcError, match="fewer than a level"):
        model(forest, x=x)
    monkeypatch.setattr(executor, "hoisted_window_rows", lambda lin: 30)  # one level a window: enough
    windowed = model(forest, x=x)
    monkeypatch.setattr(executor, "hoisted_window_rows", lambda lin: lin.num_nodes - lin.num_leaves)
    assert _digest(windowed) == _digest(model(forest, x=x))


#: run in a fresh process: the windowed inference of a chain forest at this OMP_NUM_THREADS; prints a digest
WORKER = r"""
import dataclasses, hashlib, sys
from pathlib import Path
import numpy as np
from cortexc import Forest
from cortexc.runtime.loader import import_package

module = import_package(Path(sys.argv[1]))
model = getattr(module, module.__all__[0])(device="cpu", seed=int(sys.argv[2]))
executor = model._executor_for_device()
executor.section = dataclasses.replace(executor.section, hoisted_window_rows=int(sys.argv[3]))
model._executor_for_device().direct = 1  # the hoisted node kernel (the direct one has no window)
rng = np.random.default_rng(int(sys.argv[2]))
chain = lambda n: Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)])
forest = Forest.concat([chain(200)] * 40 + [chain(int(n)) for n in rng.integers(2, 50, 60)])
out = model(forest, x=rng.standard_normal((forest.num_nodes, 7)).astype(np.float32))
h = hashlib.sha256()
for name in sorted(out):
    h.update(name.encode()); h.update(np.ascontiguousarray(out[name]).tobytes())
print(h.hexdigest())
"""


def test_windowed_inference_is_bitwise_equal_across_thread_counts(modules, rng, tmp_path):
    """Levels of 40-100 rows, which 2 and 3 threads share (tiles and windows follow the rows only)."""
    package = os.path.dirname(modules["lstm"].__file__)
    seed = int(rng.integers(0, 2**31))
    digests = {}
    for threads in (1, 2, 3):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO), CORTEXC_ADAPT_THREADS="0")
        env.pop("CORTEXC_NUM_THREADS", None)
        for window in (100, 700):
            done = subprocess.run(
                [sys.executable, "-c", WORKER, package, str(seed), str(window)], env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr
            digests[threads, window] = done.stdout.strip().splitlines()[-1]
    assert len(set(digests.values())) == 1, json.dumps({str(k): v for k, v in digests.items()})
