"""The direct node kernel (`cortexc.passes.direct`, the C driver's `cx_direct`): an inference of wide levels runs
the node body without hoisting, each sum of a hoisted and a children's product as one GEMM of the params side
by side. It must match the interpreter (random, saturated and SST inputs) and the hoisted kernel to rounding,
be chosen by the forest's mean level width only (so bitwise the same at any thread count), and never run in a
training forward."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.codegen.render import DIRECT_MIN_ROWS
from cortexc.codegen.target import TARGETS
from cortexc.ir.interp import NodeView, eval_body
from cortexc.ir.ops import Op
from cortexc.ir.program import KernelRole
from cortexc.options import CompileOptions
from cortexc.passes.direct import inline_hoisted, stack_products
from cortexc.pipeline import Source, run_stages
from tests.helpers import (
    EXAMPLES,
    REPO,
    assert_saturated_close,
    chains,
    random_inputs,
    relative_error,
    sst_path,
    twin_models,
)
from tests.helpers import digest as _digest

#: cells whose node kernel has a direct variant: a chain LSTM, the child-sum and the attentive Tree-LSTM
CELLS = {
    "lstm": ("lstm.cell", {"X": 7, "H": 9}),
    "treelstm": ("treelstm.cell", {"X": 6, "H": 8}),
    "attn": ("attn_treelstm.cell", {"X": 5, "H": 4}),
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return {key: cortexc.load(EXAMPLES / f, tmp_path_factory.mktemp(key), **dims) for key, (f, dims) in CELLS.items()}


def _programs(file: str, dims: dict[str, int]):
    path = EXAMPLES / file
    options = CompileOptions.make(dims, targets=("c", "cuda"))
    (variants,) = run_stages(Source(path.read_text(encoding="utf-8"), str(path)), options, until="target")
    return {v.target: v.program for v in variants}


def _forest(key: str, rng: np.random.Generator) -> Forest:
    """Wide levels (mean well above DIRECT_MIN_ROWS) with some of one row."""
    if key == "lstm":
        return Forest.concat([chains(40)] + [chains(int(n)) for n in rng.integers(2, 30, 60)])
    return Forest.concat([Forest.random(150, rng=rng, max_nodes=30), chains(12)])


def _run(model, forest, direct: int, **inputs):
    model._executor_for_device().direct = direct
    try:
        return model(forest, **inputs)
    finally:
        model._executor_for_device().direct = 0


@pytest.mark.parametrize(
    "file, dims, has",
    [
        ("lstm.cell", {"X": 7, "H": 9}, True),
        ("treelstm.cell", {"X": 6, "H": 8}, True),
        ("attn_treelstm.cell", {"X": 5, "H": 4}, True),
        ("treernn.cell", {}, False),
        ("lstm.cell", {"X": 100, "H": 157}, False),  # K = 257: wide enough hoisted (Target.direct_max_k = 256)
        ("lstm.cell", {"X": 100, "H": 156}, True),
        ("binary_treelstm.cell", {"V": 20, "X": 6, "H": 5, "C": 3}, False),
    ],
)
def test_the_c_program_has_a_direct_kernel_where_a_sum_mixes_a_hoisted_and_a_children_product(file, dims, has):
    """The LSTM's `W_ih @ x + W_hh @ child[0].h` becomes one GEMM of K = X + H over [W_ih | W_hh] up to the
    target's K; cells whose hoisted products are not summed with a children's product get none; CUDA never."""
    programs = _programs(file, dims)
    c = programs["c"]
    direct = [k for k in c.kernels if k.role == KernelRole.NODE_DIRECT]
    assert bool(direct) == has and bool(c.direct) == has
    assert not programs["cuda"].direct
    if has:
        (kernel,) = direct
        assert all(v.op != Op.HOISTED for v in kernel.body.values)
        assert [p.kernel for p in c.direct] == [p.kernel.replace("node", "node_direct") for p in c.forward[1:]]
        stacked = [w for w in c.packed if max(w.blocks) > 1]
        assert stacked
        for w in stacked:
            assert all(w.k == sum(c.cell.param(p).shape[1] for p, _ in row) for row in w.block_rows())


def _evaluate(body, view, hoisted=None):
    """A body's named results for node 0 of `view` (its children, states, inputs, params), in the interpreter."""
    node = NodeView(0, *view, np.float32)
    node.hoisted = hoisted or {}
    values = eval_body(body, node)
    return {name: values[i] for name, i in body.named_results}


@pytest.mark.parametrize("key", list(CELLS))
def test_the_direct_body_computes_the_node_body(key, rng):
    """Per node, in the interpreter: the node body with its hoisted values computed in place and its products
    stacked gives the states the hoisted node body gives (with the pre body's rows), to rounding."""
    file, dims = CELLS[key]
    cell = _programs(file, dims)["c"].cell
    body = stack_products(inline_hoisted(cell.pre, cell.node), TARGETS["c"].direct_max_k)
    assert body is not None and any(v.op == Op.CONCAT and len(v.shape) == 2 for v in body.values)
    params = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in cell.params}
    for children in (1, 3) if cell.arity != 1 else (1,):
        rows = children + 1  # node 0 and its children 1..
        inputs = {i.name: rng.standard_normal((rows, *i.shape)).astype(np.float32) for i in cell.inputs}
        states = {s.name: rng.standard_normal((rows, *s.shape)).astype(np.float32) for s in cell.states}

        view = (np.arange(1, rows), states, inputs, params)
        expected = _evaluate(cell.node, view, _evaluate(cell.pre, view))
        got = _evaluate(body, view)
        for name, value in expected.items():
            assert relative_error(got[name], value) < 1e-5, name


@pytest.mark.parametrize("key", list(CELLS))
def test_direct_and_hoisted_match_the_interpreter(key, modules, rng):
    model, reference = twin_models(modules[key], "cpu", int(rng.integers(0, 2**31)), rng)
    forest = _forest(key, rng)
    inputs = random_inputs(model.cell, forest, rng)
    expected = reference(forest, **inputs)
    hoisted, direct = _run(model, forest, 1, **inputs), _run(model, forest, 2, **inputs)
    for name, value in expected.items():
        assert relative_error(direct[name], value) < 1e-5, name
        assert relative_error(hoisted[name], value) < 1e-5, name
    assert _digest(hoisted) != _digest(direct)  # two kernels ran: the products are added in another order


def test_saturated_inputs_agree_with_the_interpreter_in_the_direct_kernel(modules, rng):
    """Inputs of +-100 and inf saturate every gate (and make inf - inf in the products): as the interpreter."""
    model, reference = twin_models(modules["lstm"], "cpu", 3, rng)
    forest = Forest.concat([chains(int(n)) for n in rng.integers(2, 12, 40)])
    x = rng.choice(np.array([-100.0, 100.0, np.inf, -np.inf, 0.5], np.float32), (forest.num_nodes, 7))
    got, expected = _run(model, forest, 2, x=x), reference(forest, x=x)
    for name, value in expected.items():
        assert_saturated_close(got[name], value, name)


def test_the_child_sum_tree_lstm_direct_kernel_on_sst_trees(modules, rng):
    path = sst_path("dev")
    with open(path, encoding="utf-8") as lines:
        forest = Forest.from_ptb([next(lines) for _ in range(25)])
    model, reference = twin_models(modules["treelstm"], "cpu", int(rng.integers(0, 2**31)), rng)
    inputs = random_inputs(model.cell, forest, rng)
    got, expected = _run(model, forest, 2, **inputs), reference(forest, **inputs)
    for name, value in expected.items():
        assert relative_error(got[name], value) < 1e-5, name


def test_the_driver_picks_the_direct_kernel_by_the_mean_level_width(modules, rng):
    """Chains of equal length: levels of B rows. B >= DIRECT_MIN_ROWS runs the direct kernel (bitwise what
    forcing it gives), fewer the hoisted one; whatever the threads (the choice reads the forest only)."""
    model = modules["lstm"].LSTM(device="cpu", seed=2)
    for count in (DIRECT_MIN_ROWS - 1, DIRECT_MIN_ROWS):
        forest = chains(*[50] * count)
        x = rng.standard_normal((forest.num_nodes, 7)).astype(np.float32)
        chosen = _digest(_run(model, forest, 0, x=x))
        hoisted, direct = _digest(_run(model, forest, 1, x=x)), _digest(_run(model, forest, 2, x=x))
        assert hoisted != direct
        assert chosen == (direct if count >= DIRECT_MIN_ROWS else hoisted), count


@pytest.mark.parametrize("key", ["lstm", "treelstm"])
def test_a_training_forward_never_runs_the_direct_kernel(key, modules, rng):
    """A forward kept for a backward runs the hoisted (saving) kernels even where the direct one is forced
    (bitwise the same forward), and its gradients match the interpreter's."""
    model, reference = twin_models(modules[key], "cpu", int(rng.integers(0, 2**31)), rng)
    forest = _forest(key, rng)
    inputs = random_inputs(model.cell, forest, rng)
    out = model(forest, grad=True, **inputs)
    assert _digest(dict(out)) == _digest(dict(_run(model, forest, 2, grad=True, **inputs)))
    assert _digest(dict(out)) != _digest(_run(model, forest, 2, **inputs))
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items()}
    grads = model.backward(out, upstream)
    expected = reference(forest, grad=True, **inputs)
    for name, value in reference.backward(expected, upstream).items():
        assert relative_error(grads[name], value) < 1e-5, name


#: run in a fresh process at this OMP_NUM_THREADS: the automatic inference of wide chains; prints a digest
WORKER = r"""
import hashlib, sys
from pathlib import Path
import numpy as np
from cortexc import Forest
from cortexc.runtime.loader import import_package

module = import_package(Path(sys.argv[1]))
model = getattr(module, module.__all__[0])(device="cpu", seed=int(sys.argv[2]))
rng = np.random.default_rng(int(sys.argv[2]))
chain = lambda n: Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)])
forest = Forest.concat([chain(60)] * 40 + [chain(int(n)) for n in rng.integers(2, 50, 60)])
width = model.signature.inputs[0].shape[0]
out = model(forest, x=rng.standard_normal((forest.num_nodes, width)).astype(np.float32))
h = hashlib.sha256()
for name in sorted(out):
    h.update(name.encode()); h.update(np.ascontiguousarray(out[name]).tobytes())
print(h.hexdigest())
"""


@pytest.fixture(scope="module")
def split_lstm(tmp_path_factory):
    """The chain LSTM at the benchmark's dims: its direct levels are split by columns across threads (H = 64
    is 4 blocks of 16), the inline gates' loops (`OpDef.c_inline`) in both the split and whole-width forms."""
    return cortexc.load(EXAMPLES / "lstm.cell", tmp_path_factory.mktemp("split_lstm"), X=32, H=64)


@pytest.mark.parametrize("which", ["small", "split"])
def test_the_direct_inference_is_bitwise_equal_across_thread_counts(modules, split_lstm, which, rng):
    package = os.path.dirname((modules["lstm"] if which == "small" else split_lstm).__file__)
    seed = int(rng.integers(0, 2**31))
    digests = set()
    for threads in (1, 2, 3):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO), CORTEXC_ADAPT_THREADS="0")
        env.pop("CORTEXC_NUM_THREADS", None)
        done = subprocess.run(
            [sys.executable, "-c", WORKER, package, str(seed)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        digests.add(done.stdout.strip().splitlines()[-1])
    assert len(digests) == 1
