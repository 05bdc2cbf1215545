"""Saved activations (`cortexc.passes.saving`): a training forward keeps what the gradient kernels read.

The rewritten gradient body (reading `saved` values) must compute what the recomputing one does, the C
gradient kernels must no longer recompute the gates, the backward must read the rows the forward kept,
and a backward without them is a typed error. Gradients against the interpreter and torch, and bitwise
determinism across threads, are checked for every example by test_compiled_backward, test_autodiff and
test_determinism (they all run the saving kernels now).
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import reference
from cortexc.errors import CortexcError
from cortexc.ir import interp
from cortexc.ir.ops import Op
from cortexc.ir.program import Gemm, KernelRole
from cortexc.options import CompileOptions
from cortexc.passes.autodiff import grad_body
from cortexc.passes.saving import saved_values
from cortexc.passes.schedule import schedule
from cortexc.pipeline import Job, Source, compile_file, target_stage
from cortexc.runtime.edges import to_kernel_order
from cortexc.runtime.params import check_params
from cortexc.runtime.topdown import linearize_for
from cortexc.runtime.validate import check_inputs
from tests.helpers import EXAMPLES, random_inputs, relative_error, small_forest, twin_models

DIMS = {"X": 6, "H": 5, "V": 20, "C": 3}


def _cell(path):
    declared = dict(compile_file(path)[0].dims)
    return compile_file(path, defines={k: v for k, v in DIMS.items() if k in declared})[0]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.cell")), ids=lambda p: p.stem)
def test_the_saving_gradient_body_computes_what_the_recomputing_one_does(path, rng):
    """Per node of a random forest (float64, the interpreter): the forward body's chosen values as a saved
    row, then both GRAD bodies from the same adjoints; every gradient result agrees."""
    cell = _cell(path)
    forest = small_forest(cell, rng, 4, 9, chains=(4, 2), dag_nodes=15)
    lin = linearize_for(cell.signature(), forest)  # a graph cell's unrolled steps
    params = check_params(cell, {p.name: rng.standard_normal(p.shape) * 0.5 for p in cell.params}, dtype=np.float64)
    inputs = check_inputs(cell, forest, random_inputs(cell, forest, rng), np.float64)
    inputs = to_kernel_order(cell.signature(), forest, inputs)  # edge inputs by the kernels' edges
    states = reference.run_linearized(cell, lin, params, inputs, np.float64)
    saved_any = False
    for position in range(lin.num_nodes):
        index = int(lin.level_order[position])
        children = reference._children(lin, position)
        leaf = position < lin.num_leaves
        forward = cell.leaf if leaf else cell.node
        edges, prev = reference._edges(lin, position), reference._prev(lin, position, index)
        row = reference._input_row(lin, index)
        node = interp.NodeView(
            index, children, states, inputs, params, np.float64, edges=edges, prev=prev, input_row=row
        )
        if not leaf:
            node.hoisted = reference._hoisted(cell, node)
        chosen = saved_values(forward)
        saved_any |= bool(chosen)
        values = interp.eval_body(forward, node)
        row = np.concatenate([np.ravel(values[i]) for i in chosen]) if chosen else np.zeros(0)
        columns = np.cumsum([0] + [np.size(values[i]) for i in chosen])[:-1]
        where = {i: ("s", int(c)) for i, c in zip(chosen, columns)}
        node.adjoints = {name: rng.standard_normal(np.shape(values[i])) for name, i in forward.named_results}
        node.saved = {"s": row}
        recomputing, saving = grad_body(forward), grad_body(forward, where)
        assert sum(v.op == Op.SAVED for v in saving.values) == len(chosen)
        expected = interp.eval_body(recomputing, node)
        got = interp.eval_body(saving, node)
        assert [t for t, _ in recomputing.grad_results] == [t for t, _ in saving.grad_results]
        for (target, a), (_, b) in zip(recomputing.grad_results, saving.grad_results):
            np.testing.assert_allclose(got[b], expected[a], rtol=1e-12, atol=1e-12, err_msg=str(target))
    assert saved_any, "nothing of this cell is worth keeping?"


def test_the_lstm_gradient_kernels_recompute_no_gate_and_no_forward_product():
    """The C program's gradient kernels read the gates (5 H floats per node: the sigmoids, tanh(u) and
    tanh(c)); their only GEMMs multiply by a transposed weight. The CUDA program keeps recomputing."""
    cell = _cell(EXAMPLES / "lstm.cell")
    job = Job(Source("", "lstm.cell"), CompileOptions(targets=("c", "cuda")))
    programs = {v.target: v.program for v in target_stage((schedule(cell),), job)[0]}
    c_program = programs["c"]
    widths = {v.name: v.width for v in c_program.saved}
    assert widths == {"leaf": 4 * DIMS["H"], "node": 5 * DIMS["H"]}
    for role in (KernelRole.GRAD_NODE, KernelRole.GRAD_LEAF):
        kernel = c_program.role(role)
        ops = {v.op for v in kernel.body.values}
        assert not ops & {Op.SIGMOID, Op.TANH}, f"{kernel.name} recomputes a gate"
        packed = {w.name: w for w in c_program.packed}
        assert all(all(packed[s.packed].transposed) for s in kernel.steps if isinstance(s, Gemm))
    recomputing = schedule(cell).role(KernelRole.GRAD_NODE)
    assert {Op.SIGMOID, Op.TANH} <= {v.op for v in recomputing.body.values}
    assert programs["cuda"].saved == () and programs["cuda"].role(KernelRole.GRAD_NODE).body == recomputing.body


@pytest.fixture(scope="module")
def lstm(tmp_path_factory):
    return cortexc.load(EXAMPLES / "lstm.cell", out_dir=tmp_path_factory.mktemp("lstm"), X=6, H=16)


def test_the_backward_reads_the_rows_the_forward_kept(lstm, rng):
    """A kept forward's saved arrays are every row of the leaves' and internal nodes' gates; gradients
    from them match the interpreter, and poisoning them (NaN) after the forward reaches every gradient."""
    model, ref = twin_models(lstm, "cpu", 7, rng)
    forest = small_forest(model.cell, rng, 0, 0, chains=(9, 4, 1, 6))
    inputs = random_inputs(model.cell, forest, rng)
    out, expected = model(forest, grad=True, **inputs), ref(forest, grad=True, **inputs)
    kept = out.saved[3]
    lin = kept.lin
    assert [a.shape for a in kept.activations] == [(lin.num_leaves, 64), (lin.num_nodes - lin.num_leaves, 80)]
    assert all(np.isfinite(a).all() for a in kept.activations)  # every row written
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
    grads, expected_grads = model.backward(out, upstream), ref.backward(expected, upstream)
    for name, value in expected_grads.items():
        assert relative_error(grads[name], value) < 1e-5, name
    again = model(forest, grad=True, **inputs)
    for array in again.saved[3].activations:
        array[...] = np.nan
    poisoned = model.backward(again, upstream)
    assert all(np.isnan(poisoned[name]).any() for name in ("W_hh", "b_ih", "W_ih"))


def test_a_backward_without_the_saved_activations_is_a_typed_error(lstm, rng):
    model = getattr(lstm, lstm.__all__[0])(device="cpu", seed=2)
    forest = small_forest(model.cell, rng, 0, 0, chains=(3, 2))
    inputs = random_inputs(model.cell, forest, rng)
    out = model(forest, grad=True, **inputs)
    executor, kept = model._executor, out.saved[3]
    with pytest.raises(CortexcError, match="saved"):
        executor.run_backward(kept.lin, executor._weights[0], kept.inputs, kept.states, kept.hoisted, ((),) * 5)
    wrong = [np.zeros((1, 3), np.float32) for _ in kept.activations]
    with pytest.raises(CortexcError, match="do not fit"):
        executor.run_backward(
            kept.lin, executor._weights[0], kept.inputs, kept.states, kept.hoisted, ((),) * 5, activations=wrong
        )
