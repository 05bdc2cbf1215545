"""Edge inputs (language Version 3): `input w[D] on edge` and `input rel : index[R] on edge`, given as `[E, D]`
/ `[E]` arrays in the forest's edge order and read as `edge.w` / `edge.rel`, with relation-indexed matrices
`U[edge.rel] @ child.h` and tables `E[edge.rel]`. Forward and backward (the float edge inputs' gradients are
`[E, D]`, in edge order) on the interpreter, the compiled C and the emulated CUDA, against per-node float64
PyTorch written here from the forest's own edge arrays; the runtime's typed errors; the located ones; 1 and 2
threads bitwise; nvcc."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import CellTypeError, InputError
from cortexc.frontend import lower_source
from tests.helpers import (
    assert_packages_compile_with_nvcc_without_spills,
    digests_at_thread_counts,
    relative_error,
    shuffled_ids,
)

torch = pytest.importorskip("torch")

DEVICES = ["interp", "cpu", "cuda-emu"]

#: a DAG-LSTM-style cell with typed edges (Zhu et al. 2016's DAG-LSTM, with relation-indexed recurrent
#: weights as in Peng et al. 2017's Graph-LSTM): each edge has a relation and a float feature vector
TYPED_DAG = """
cell TypedDag on dag {
    dim X = 4, H = 5, D = 3, R = 3
    input x[X]
    input w[D] on edge
    input rel : index[R] on edge
    param W[4*H, X], U[R, 4*H, H], V[4*H, D], b[4*H]
    state h[H], c[H]
    node {
        g = W @ x + sum(U[edge.rel] @ child.h + V @ edge.w) + b
        f = sigmoid(g[H:2*H])
        c = sigmoid(g[0:H]) * tanh(g[2*H:3*H]) + f * sum(child.c)
        h = sigmoid(g[3*H:4*H]) * tanh(c)
    }
}
"""

#: a tree cell whose edges carry a label looked up in a table of vectors, gating each child
LABELLED_TREE = """
cell LabelledTree on tree {
    dim X = 4, H = 6, L = 5
    input x[X]
    input label : index[L] on edge
    input weight[1] on edge
    param W[H, X], U[H, H], E[L, H], b[H]
    state h[H]
    node { h = tanh(W @ x + sum(sigmoid(E[edge.label]) * (U @ child.h)) * 0.5 + sum(edge.weight * child.h) + b) }
}
"""


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("edge_inputs")
    built = {}
    for name, text in (("dag", TYPED_DAG), ("tree", LABELLED_TREE)):
        path = out / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        built[name] = cortexc.load(path, out_dir=out / name)
    return built


def _forests(kind: str, seed: int) -> dict[str, Forest]:
    rng = np.random.default_rng(seed)
    if kind == "dag":
        return {
            "dag": Forest.random_dag(40, rng=rng, max_children=4, max_parents=3),
            "concat": Forest.concat([Forest.random_dag(12, rng=rng), Forest.from_parents([-1])]),
        }
    tree = Forest.random(6, rng=rng, max_children=4, max_nodes=15)
    return {
        "shuffled": shuffled_ids(tree, rng),
        "chain": Forest.from_parents([1, 2, 3, -1]),
        "single": Forest.from_parents([-1]),
        "concat": Forest.concat([Forest.from_parents([-1]), tree, Forest.from_parents([2, 2, -1])]),
    }


def _inputs(model, forest: Forest, rng: np.random.Generator) -> dict[str, np.ndarray]:
    inputs = {}
    for decl in model.signature.inputs:
        rows = forest.num_edges if decl.on_edge else forest.num_nodes
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, rows).astype(np.int32)
        else:
            inputs[decl.name] = rng.standard_normal((rows, *decl.shape)).astype(np.float32)
    return inputs


def _edges_of(forest: Forest, node: int) -> list[tuple[int, int]]:
    """(edge number, child) of each edge to a child of `node`, from the forest's own CSR arrays."""
    start, stop = int(forest.edge_ptr[node]), int(forest.edge_ptr[node + 1])
    return [(e, int(forest.edge_child[e])) for e in range(start, stop)]


def _typed_dag_reference(forest: Forest, p: dict, x, w, rel) -> dict:
    hs, cs = {}, {}
    H = p["b"].shape[0] // 4
    for node in (int(n) for n in forest.level_order):
        g = p["W"] @ x[node] + p["b"]
        c_sum = torch.zeros(H, dtype=torch.float64)
        for e, kid in _edges_of(forest, node):
            g = g + p["U"][int(rel[e])] @ hs[kid] + p["V"] @ w[e]
            c_sum = c_sum + cs[kid]
        f = torch.sigmoid(g[H : 2 * H])
        cs[node] = torch.sigmoid(g[:H]) * torch.tanh(g[2 * H : 3 * H]) + f * c_sum
        hs[node] = torch.sigmoid(g[3 * H :]) * torch.tanh(cs[node])
    order = range(forest.num_nodes)
    return {"h": torch.stack([hs[i] for i in order]), "c": torch.stack([cs[i] for i in order])}


def _labelled_reference(forest: Forest, p: dict, x, label, weight) -> dict:
    hs = {}
    for node in (int(n) for n in forest.level_order):
        total = p["W"] @ x[node] + p["b"]
        for e, kid in _edges_of(forest, node):
            total = total + 0.5 * torch.sigmoid(p["E"][int(label[e])]) * (p["U"] @ hs[kid]) + weight[e] * hs[kid]
        hs[node] = torch.tanh(total)
    return {"h": torch.stack([hs[i] for i in range(forest.num_nodes)])}


REFERENCES = {"dag": ("TypedDag", _typed_dag_reference), "tree": ("LabelledTree", _labelled_reference)}


def _check(model, forest: Forest, reference, inputs: dict, rng: np.random.Generator, what: str) -> None:
    """Forward, every param gradient and every float (node or edge) input gradient against the reference."""
    params = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in model.params.items()}
    floats = {
        d.name: torch.tensor(np.asarray(inputs[d.name], np.float64), requires_grad=True)
        for d in model.signature.inputs
        if not d.is_index
    }
    args = [floats.get(d.name, inputs[d.name]) for d in model.signature.inputs]
    expected = reference(forest, params, *args)
    out = model(forest, grad=True, **inputs)
    for name, value in expected.items():
        assert relative_error(out[name], value.detach().numpy()) < 1e-5, f"{what}: {name}"
    upstream = {name: rng.standard_normal(value.shape) for name, value in expected.items()}
    sum((value * torch.tensor(upstream[name])).sum() for name, value in expected.items()).backward()
    grads = model.backward(out, {k: v.astype(np.float32) for k, v in upstream.items()})
    assert set(grads) == set(params) | set(floats)
    for name, leaf in {**params, **floats}.items():
        want = np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.numpy()
        assert grads[name].shape == tuple(leaf.shape), f"{what}: d{name} shape"
        assert relative_error(grads[name], want) < 1e-5, f"{what}: d{name}"


#: (cell, forest) pairs: DAGs with shared nodes, trees with shuffled ids, chains, single nodes, concatenations
CASES = [("dag", "dag"), ("dag", "concat"), *(("tree", s) for s in ("shuffled", "chain", "single", "concat"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "shape"), CASES)
def test_edge_inputs_match_per_node_torch(modules, device, kind, shape):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh every run; in the message on failure
    name, reference = REFERENCES[kind]
    model = getattr(modules[kind], name)(device=device, seed=seed)
    rng = np.random.default_rng(seed)
    model.load_params({k: v + (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()})
    forest = _forests(kind, seed)[shape]
    _check(model, forest, reference, _inputs(model, forest, rng), rng, f"{device} {shape} seed {seed}")


def test_edge_inputs_are_read_in_the_forests_edge_order(modules, rng):
    """Permuting the edges' rows changes the result exactly as permuting the forest's children does."""
    model = modules["tree"].LabelledTree(device="cpu", seed=1)
    forest = Forest.from_parents([3, 3, 3, -1])
    inputs = _inputs(model, forest, rng)
    inputs["weight"] = np.array([[0.0], [0.0], [5.0]], np.float32)  # only the edge to node 2 weighs
    got = model(forest, **inputs)["h"]
    moved = dict(inputs, weight=np.array([[5.0], [0.0], [0.0]], np.float32))  # now the edge to node 0
    other = model(forest, **moved)["h"]
    assert not np.allclose(got[3], other[3])
    reference = modules["tree"].LabelledTree(device="interp", seed=1)
    assert relative_error(got, reference(forest, **inputs)["h"]) < 1e-5


def test_bad_edge_inputs_are_typed_errors_naming_the_edge(modules, rng):
    model = modules["dag"].TypedDag(device="cpu", seed=0)
    forest = Forest.from_parents([2, 2, -1])
    good = _inputs(model, forest, rng)
    with pytest.raises(InputError, match=r"input w must have shape \(2, 3\) \(one row per edge\)"):
        model(forest, **dict(good, w=np.zeros((3, 3), np.float32)))
    with pytest.raises(InputError, match=r"input rel must have shape \(2,\) \(one index per edge\)"):
        model(forest, **dict(good, rel=np.zeros(3, np.int32)))
    with pytest.raises(InputError, match=r"input rel: edge 1 \(node 1 -> node 2\) has index 7, outside \[0, 3\)"):
        model(forest, **dict(good, rel=np.array([0, 7], np.int32)))
    with pytest.raises(InputError, match="must be integers"):
        model(forest, **dict(good, rel=np.zeros(2, np.float32)))


ERRORS = [
    ("h = tanh(W @ x + sum(U @ child.h) + w[0:1])", "'w' is an edge input: read it as edge.w", "w[0:1]"),
    ("h = tanh(W @ x + sum(U @ child.h) * edge.x[0:1])", "'x' is a node input, read as x", "edge.x"),
    ("h = tanh(W @ x + sum(edge.wt * child.h))", "unknown edge value 'wt' in edge.wt", "edge.wt"),
    ("h = tanh(W @ x + edge[2].w[0:1] * sum(child.h))", "edge[2].w is out of the declared arity 2", "2]"),
    ("h = tanh(W @ x + edge[0].rel * sum(child.h))", "it can only select a row of a param", "edge[0]"),
    ("h = tanh(W @ x + E[rel])", "'rel' is an edge input: read it as edge.rel", "rel]"),
]


@pytest.mark.parametrize(("body", "message", "at"), ERRORS, ids=[e[1][:30] for e in ERRORS])
def test_edge_input_errors_are_located(body, message, at):
    source = (
        "cell E on tree(arity = 2) {\n    dim X = 4, H = 4, D = 2, R = 3\n    input x[X]\n"
        "    input w[D] on edge, rel : index[R] on edge\n"
        f"    param W[H, X], U[H, H], E[R, H]\n    state h[H]\n    node {{ {body} }}\n}}\n"
    )
    with pytest.raises(CellTypeError) as err:
        lower_source(source, "e.cell")
    text = str(err.value)
    assert message in text, text
    assert text.startswith(f"e.cell:7:{source.splitlines()[6].index(at) + 1}:"), text


def test_edge_inputs_are_not_visible_in_leaf_blocks_or_outputs():
    for where in ("leaf { h = tanh(edge.w) }\n    node { h = tanh(sum(child.h)) }", "node { h = tanh(sum(child.h)) }"):
        output = "" if "leaf" in where else "\n    output o[2] = edge.w"
        source = f"cell E on tree {{\n    dim D = 2\n    input w[D] on edge\n    state h[D]\n    {where}{output}\n}}\n"
        with pytest.raises(CellTypeError, match="edge.w in (a leaf block|an output)"):
            lower_source(source, "e.cell")


WORKER = r"""
import json, sys
import numpy as np
import cortexc
from cortexc import Forest
module = cortexc.load(sys.argv[1], out_dir=sys.argv[2])
model = module.TypedDag(device="cpu", seed=3)
rng = np.random.default_rng(5)
forest = Forest.random_dag(400, rng=rng, max_children=4, max_parents=4)
inputs = {"x": rng.standard_normal((forest.num_nodes, 4)).astype(np.float32),
          "w": rng.standard_normal((forest.num_edges, 3)).astype(np.float32),
          "rel": rng.integers(0, 3, forest.num_edges).astype(np.int32)}
out = model(forest, grad=True, **inputs)
grads = model.backward(out, {"h": np.ones_like(out["h"])})
from tests.helpers import digest  # the worker runs in the checkout
print(json.dumps(digest({**out, **{f"d_{name}": value for name, value in grads.items()}})))
"""


@pytest.mark.slow
def test_one_and_two_threads_give_the_same_bits(tmp_path):
    digests = digests_at_thread_counts(WORKER, TYPED_DAG, tmp_path)
    assert digests[0] == digests[1]


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_edge_input_cells_compile_with_nvcc_without_spills(modules):
    assert_packages_compile_with_nvcc_without_spills(modules.values())
