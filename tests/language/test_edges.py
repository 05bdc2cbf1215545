"""Edges (language Version 3, first part): `forest.edge_*` in the spec's order, and `edge.position`,
`edge.siblings`, `edge[k].NAME` in cells, on the interpreter (against a per-node float64 reference written
here), the compiled C and the emulated CUDA (against the interpreter, forward and backward), with their
located errors. Edge inputs (`on edge`) are not built yet."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest, reference
from cortexc.errors import CellSyntaxError, CellTypeError
from cortexc.frontend import lower_source
from cortexc.passes.specialize import specialize
from tests.helpers import compare_backward, nvcc_compile, random_inputs, relative_error

#: the continuous binary tree of TBCNN (Mou et al. 2016): a child's weights mix a left and a right matrix by
#: its place among its siblings (an only child gets half of each), plus the number of children as a feature
TBCNN = """
cell TBCNN on tree {
    dim X = 6, H = 8
    input x[X]
    param W[H, X], W_l[H, H], W_r[H, H], b[H], w_n[H]
    state h[H]
    node {
        r = maximum(edge.siblings - 1, 1)
        left = (edge.siblings - 1 - edge.position) / r + 0.5 * (1 - minimum(edge.siblings - 1, 1))
        h = tanh(W @ x + sum(left * (W_l @ child.h)) + sum((1 - left) * (W_r @ child.h)) + w_n * sum(edge.siblings) + b)
    }
}
"""

#: a binary cell reading the edges to children 0 and 1 (0 where the child is missing), and a DAG cell whose
#: shared children are at different places under their parents
ARITY = """
cell Edges2 on tree(arity = 2) {
    dim X = 4, H = 5
    input x[X]
    param W[H, X], U[H, H], V[H, H]
    state h[H]
    node {
        h = tanh(W @ x + (1 + edge[1].position) * (U @ child[0].h) + edge[0].siblings * (V @ child[1].h))
    }
}
"""

DAG = """
cell EdgesDag on dag {
    dim X = 4, H = 5
    input x[X]
    param W[H, X], U[H, H]
    state h[H]
    node { h = tanh(W @ x + sum((edge.position + 1) / edge.siblings * (U @ child.h))) }
}
"""


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges")
    built = {}
    for name, text in (("tbcnn", TBCNN), ("arity", ARITY), ("dag", DAG)):
        path = out / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        built[name] = cortexc.load(path, out_dir=out / "packages")
    return built


def _forest(kind: str, seed: int) -> Forest:
    rng = np.random.default_rng(seed)
    if kind == "dag":
        return Forest.random_dag(40, rng=rng)
    return Forest.random(8, rng=rng, max_children=2 if kind == "arity" else 5, max_nodes=25, binary=False)


# --------------------------------------------------------------------------- the forest's edges


@pytest.mark.parametrize("kind", ["tree", "dag"])
def test_forest_edges_are_numbered_by_parent_then_in_children_order(kind):
    forest = _forest(kind, 3)
    assert forest.num_edges == int(forest.num_children.sum())
    assert forest.edge_ptr.shape == (forest.num_nodes + 1,) and forest.edge_ptr[-1] == forest.num_edges
    for parent in range(forest.num_nodes):
        edges = slice(forest.edge_ptr[parent], forest.edge_ptr[parent + 1])
        assert list(forest.edge_child[edges]) == list(forest.children(parent))
        assert set(forest.edge_parent[edges]) <= {parent}
    assert np.all(np.diff(forest.edge_parent) >= 0)


# --------------------------------------------------------------------------- meaning


def _tbcnn_reference(forest: Forest, params, x: np.ndarray) -> np.ndarray:
    """TBCNN per node in float64, children before parents, written from the formula."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = np.zeros((forest.num_nodes, p["b"].shape[0]))
    for node in forest.level_order:
        kids = forest.children(node)
        n = len(kids)
        total = p["W"] @ x[node] + p["w_n"] * n * n + p["b"]  # sum(edge.siblings): n children each seeing n
        for position, kid in enumerate(kids):
            left = 0.5 if n == 1 else (n - 1 - position) / (n - 1)
            total = total + left * (p["W_l"] @ h[kid]) + (1 - left) * (p["W_r"] @ h[kid])
        h[node] = np.tanh(total)
    return h


def test_tbcnn_on_the_interpreter_matches_a_per_node_reference(modules):
    model = modules["tbcnn"].TBCNN(device="interp", seed=5)
    forest = _forest("tree", 11)
    x = np.random.default_rng(2).standard_normal((forest.num_nodes, 6)).astype(np.float32)
    got = model(forest, x=x)["h"]
    expected = _tbcnn_reference(forest, model.params, x)
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
@pytest.mark.parametrize("name", ["tbcnn", "arity", "dag"])
def test_edge_values_compiled_match_the_interpreter_forward_and_backward(modules, name, device):
    module = modules[name]
    cls = getattr(module, module.__all__[0])
    compiled, reference = cls(device=device, seed=4), cls(device="interp", seed=4)
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        forest = _forest({"tbcnn": "tree"}.get(name, name), seed)
        inputs = random_inputs(reference.cell, forest, rng)
        out, expected = compiled(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
        for key, value in expected.items():
            assert relative_error(out[key], value) < 1e-5, key
        compare_backward(compiled, reference, out, expected, rng)


def test_edge_at_reads_zero_for_a_missing_child():
    """`edge[1].position` is 1 where child 1 exists, 0 where the node has only child 0 (or none)."""
    cell_text = """
cell E on tree(arity = 2) {
    state p[1], s[1]
    node { p = edge[1].position + 10 * edge[0].position; s = edge[1].siblings + 10 * edge[0].siblings }
}"""
    (cell,) = lower_source(cell_text)
    forest = Forest.from_parents([3, 2, 3, -1])  # 3 has children 0 and 2; 2 has only child 1; 0, 1 leaves
    out = reference.run(specialize(cell), forest, {}, {})
    np.testing.assert_array_equal(out["p"][:, 0], [0, 0, 0, 1])
    np.testing.assert_array_equal(out["s"][:, 0], [0, 0, 10, 22])


# --------------------------------------------------------------------------- errors


def _body(line: str, on: str = "tree") -> str:
    return f"cell C on {on} {{\n    input x[2]\n    state h[2]\n    node {{ {line} }}\n}}\n"


@pytest.mark.parametrize(
    "text, error, message",
    [
        (_body("h = x * sum(edge.positon)"), CellTypeError, "unknown edge value 'positon' in edge.positon: an edge"),
        (_body("h = x * sum(edge.positon)"), CellTypeError, "did you mean 'position'"),
        (_body("h = x * edge[0].position"), CellTypeError, "edge[0].position needs a cell with an arity"),
        (_body("h = x * edge[2].position", "tree(arity = 2)"), CellTypeError, "out of the declared arity 2"),
        (
            "cell C on tree {\n    input x[2]\n    state h[2]\n    leaf { h = x * edge.position }\n"
            "    node { h = x }\n}\n",
            CellTypeError,
            "edge.position in a leaf block: leaves have no children",
        ),
        (
            "cell C on tree {\n    input x[2]\n    state h[2]\n    node { h = x }\n"
            "    output o[1] = edge.siblings\n}\n",
            CellTypeError,
            "edge.siblings in an output",
        ),
        (
            "cell C on tree {\n    input edge[2]\n    state h[2]\n    node { h = edge }\n}\n",
            CellSyntaxError,
            "'edge' is a keyword from Version 3 of the language on",
        ),
        (_body("h = x * edge.position"), CellTypeError, "state 'h' is assigned a per-child value: reduce it"),
    ],
)
def test_edge_errors_are_located(text, error, message):
    with pytest.raises(error) as caught:
        lower_source(text, "e.cell")
    assert message in str(caught.value)
    assert re.search(r"e\.cell:\d+:\d+", str(caught.value))


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_edge_cells_compile_with_nvcc(modules):
    for module in modules.values():
        (source,) = Path(next(iter(module.__path__))).glob("*.cu")
        result = nvcc_compile(source, device_only=True, generated=True)
        assert result.returncode == 0, result.stderr[-3000:]
