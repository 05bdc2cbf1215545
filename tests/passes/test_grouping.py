"""Grouped GEMMs (`cortexc.passes.grouping`): a family's products chosen per row (`U[edge.rel] @ child.h`,
`U[edge.position] @ parent.h`) are computed for each row's own matrix alone on the C target.

Which GEMMs are grouped (and which are not: a node's product read by each child's choice, a split or folded
GEMM), and, end to end, the grouped package against the same package built without the pass: outputs and
every gradient bitwise equal (each element is the same sum over k), on DAGs with random relations and odd
widths (groups that start and end inside a GEMM panel), SST trees for a down cell, 1 and 2 threads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.codegen.target import TARGETS
from cortexc.ir.program import AccumOuter, Gemm, Grouped
from cortexc.options import CompileOptions
from cortexc.passes.grouping import group_products
from cortexc.pipeline import Source, run_stages
from tests.helpers import EXAMPLES, random_inputs, sst_path

#: a binary cell whose node products are the node's (child[k].h) but chosen by each child's relation
PER_CHILD_CHOICE = """
cell TypedBinary on tree(arity = 2) {
    dim H = 4, R = 3
    input x[H]
    input rel : index[R] on edge
    param U[R, H, H], W[H, H]
    state h[H]
    leaf { h = tanh(W @ x) }
    node { h = tanh(U[edge[0].rel] @ child[0].h + U[edge[1].rel] @ child[1].h) }
}
"""

#: one operand, three stacked products: one chosen per child by its relation, one read whole, one chosen by
#: the position (both families chosen per row: two grouped ranges around a plain one)
MIXED = """
cell Mixed on dag {
    dim X = 5, H = 20, R = 3
    input x[X]
    input rel : index[R] on edge
    param U[R, H, H], V[H, H], P[4, H, H], W[H, X]
    state h[H]
    node { h = tanh(W @ x + sum(U[edge.rel] @ child.h + V @ child.h + P[edge.rel] @ child.h)) }
}
"""


def _c_program(text: str, name: str = "cell.cell"):
    options = CompileOptions.make(targets=("c",))
    return run_stages(Source(text, name), options, until="target")[0][0].program


def _grouped_steps(program) -> dict[str, list[Gemm]]:
    return {k.name: [s for s in k.steps if isinstance(s, Gemm) and s.grouped] for k in program.kernels if k.steps}


def test_a_typed_dag_lstm_computes_each_childs_relation_only():
    program = _c_program((EXAMPLES / "typed_daglstm.cell").read_text(), "typed_daglstm.cell")
    grouped = _grouped_steps(program)
    for name in ("node", "grad_node"):  # the forward, and its recomputation in the backward
        (gemm,) = grouped[name]
        assert gemm.weights == ("U", "U_f")
        kernel = next(k for k in program.kernels if k.name == name)
        rel = next(i for i, v in enumerate(kernel.body.values) if v.attr("name") == "rel")
        assert gemm.grouped == (Grouped(0, 96, 4, rel), Grouped(384, 32, 4, rel))
        scratch = next(b for b in kernel.buffers if b.name == gemm.scratch)
        assert scratch.rows == gemm.rows and scratch.width >= 96 + 2 * 16 + 2
    assert not grouped["leaf"] and not grouped.get("pre")
    # the backward's d child.h = U[rel]^T d: over the row's relation's k of the transposed family alone
    kernel = next(k for k in program.kernels if k.name == "grad_node")
    by_k = [s for s in kernel.steps if isinstance(s, Gemm) and s.grouped_k is not None]
    assert sorted(s.weights for s in by_k) == [("U",), ("U_f",)]
    assert sorted((s.grouped_k.width, s.grouped_k.groups) for s in by_k) == [(32, 4), (96, 4)]
    # and its weight gradients d U[r] add the rows of relation r alone
    outer = {s.param: s.grouped for s in kernel.steps if isinstance(s, AccumOuter)}
    assert (outer["U"].width, outer["U"].groups, outer["U_f"].width) == (96, 4, 32) and outer["V"] is None


def test_a_down_cell_groups_by_the_position_an_earlier_step_computes():
    text = (EXAMPLES / "bitreelstm.cell").read_text()
    program = run_stages(Source(text, "bitreelstm.cell"), CompileOptions.make(targets=("c",)), until="target")
    down = next(variants[0].program for variants in program if variants[0].program.cell.name == "BiTreeLSTMDown")
    (gemm,) = _grouped_steps(down)["node"]
    assert gemm.weights == ("U",) and [(g.lo, g.width, g.groups) for g in gemm.grouped] == [(0, 600, 2)]


def test_a_nodes_product_chosen_by_each_child_is_not_grouped():
    """`U[edge[k].rel] @ child[k].h`: one product per node, but the choice is each child's: a row of the GEMM
    needs several groups."""
    program = _c_program(PER_CHILD_CHOICE)
    assert not any(_grouped_steps(program).values())


def test_plain_columns_stay_between_grouped_ranges():
    program = _c_program(MIXED)
    (gemm,) = _grouped_steps(program)["node"]
    assert gemm.weights == ("U", "V", "P")
    assert [(g.lo, g.width, g.groups) for g in gemm.grouped] == [(0, 20, 3), (80, 20, 4)]


def test_the_pass_leaves_the_cuda_program_and_split_gemms_alone():
    program = _c_program((EXAMPLES / "treelstm.cell").read_text(), "treelstm.cell")
    assert group_products(program) == program  # nothing chosen per row
    cuda = run_stages(
        Source((EXAMPLES / "typed_daglstm.cell").read_text(), "typed_daglstm.cell"),
        CompileOptions.make(targets=("cuda",)),
        until="target",
    )[0][0].program
    assert not any(_grouped_steps(cuda).values())


def _ungrouped(monkeypatch):
    """The C target without this pass, as `TARGETS` reads it from the target's folder."""
    c = TARGETS["c"]
    plain = dataclasses.replace(c, passes=tuple(p for p in c.passes if p is not group_products))
    monkeypatch.setattr("cortexc.targets.c.target.TARGET", plain)


def _dag(rng, n: int) -> Forest:
    src, dst = [], []
    for v in range(1, n):
        for p in set(rng.integers(0, v, 2).tolist()):
            src.append(p)
            dst.append(v)
    order = rng.permutation(n)  # ids not in topological order
    return Forest.from_edges(order[np.array(src, np.int64)], order[np.array(dst, np.int64)], num_nodes=n)


def _run(model, forest, inputs, rng_seed: int):
    out = model(forest, grad=True, **inputs)
    rng = np.random.default_rng(rng_seed)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items() if isinstance(v, np.ndarray)}
    return {**{f"out/{k}": v for k, v in out.items() if isinstance(v, np.ndarray)}, **model.backward(out, upstream)}


@pytest.mark.parametrize(
    "file, dims",
    [
        ("typed_daglstm.cell", {"H": 20, "R": 3, "X": 7}),  # narrow weight gradients: per tile, or kept
        ("typed_daglstm.cell", {"H": 32}),
        ("typed_daglstm.cell", {"H": 112, "R": 3, "X": 5}),  # U's deferred (m * k >= 96 (m + k)), tail panels
        ("mixed", {}),
    ],
)
def test_grouped_and_ungrouped_packages_agree_bitwise(file, dims, tmp_path, monkeypatch):
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    path = tmp_path / "mixed.cell"
    path.write_text(MIXED, encoding="utf-8")
    source = path if file == "mixed" else EXAMPLES / file
    grouped = cortexc.load(source, out_dir=tmp_path / "grouped", **dims)
    with monkeypatch.context() as m:
        _ungrouped(m)
        plain = cortexc.load(source, out_dir=tmp_path / "plain", **dims)
    name = "Mixed" if file == "mixed" else "TypedDagLSTM"
    (kernels,) = (tmp_path / "grouped").glob(f"*/{name}.c")
    (plain_kernels,) = (tmp_path / "plain").glob(f"*/{name}.c")
    assert "cx_gemm_grouped(cx_rows" in kernels.read_text()
    assert "cx_gemm_grouped(cx_rows" not in plain_kernels.read_text()
    if file != "mixed":  # the weight gradients' per-tile sums and deferred phase by relation
        assert "cx_gemm_tn_acc(cx_n" in kernels.read_text() and "(const int32_t *)call->inputs[" in kernels.read_text()
    forests = [_dag(rng, 50), Forest.concat([_dag(rng, 30), _dag(rng, 1), _dag(rng, 12)])]
    for forest in forests:
        a = getattr(grouped, name)(device="cpu", seed=seed % 1000)
        b = getattr(plain, name)(device="cpu", seed=seed % 1000)
        inputs = random_inputs(a.signature, forest, rng)
        for threads in ("1", "2"):
            monkeypatch.setenv("CORTEXC_NUM_THREADS", threads)
            got, want = _run(a, forest, inputs, seed), _run(b, forest, inputs, seed)
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=f"{key} seed={seed}")


def test_a_down_cell_grouped_by_position_agrees_bitwise_on_sst(tmp_path, monkeypatch):
    dev = sst_path("dev")
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    lines = dev.read_text(encoding="utf-8").splitlines()
    forest = Forest.from_ptb([lines[i] for i in rng.choice(len(lines), 20, replace=False)])
    dims = {"V": 50, "X": 12, "H": 20}
    grouped = cortexc.load(EXAMPLES / "bitreelstm.cell", out_dir=tmp_path / "grouped", **dims)
    with monkeypatch.context() as m:
        _ungrouped(m)
        plain = cortexc.load(EXAMPLES / "bitreelstm.cell", out_dir=tmp_path / "plain", **dims)
    a = grouped.BiTreeLSTMDown(device="cpu", seed=1)
    b = plain.BiTreeLSTMDown(device="cpu", seed=1)
    inputs = random_inputs(a.signature, forest, rng)
    got, want = _run(a, forest, inputs, seed), _run(b, forest, inputs, seed)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=f"{key} seed={seed}")
