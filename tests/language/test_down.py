"""Top-down cells (language Version 3): `cell NAME on tree down` / `on dag down`, computing a node after its
parent(s) and reading them as `parent.s` (per node on a tree, 0 at a root; per parent on a DAG, reduced),
with an optional `root {}` block and outputs per node or at the forest's roots. Forward and backward on the
interpreter, the compiled C and the emulated CUDA against per-node float64 PyTorch written here (and, on
chains, `torch.nn.LSTM` on the flipped sequence); the reversed forest; the located errors; 1 and 2 threads
bitwise; nvcc."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import CellSyntaxError, CellTypeError, CortexcError
from cortexc.frontend import lower_source
from cortexc.runtime.topdown import linearize_down, reversed_forest
from tests.helpers import (
    assert_packages_compile_with_nvcc_without_spills,
    digests_at_thread_counts,
    relative_error,
    shuffled_ids,
    sst_path,
)

torch = pytest.importorskip("torch")

DEVICES = ["interp", "cpu", "cuda-emu"]

#: the top-down Tree-LSTM of the spec without per-position weights: torch.nn.LSTM's gates (i, f, g, o)
DOWN_LSTM = """
cell DownLSTM on tree down {
    dim X = 4, H = 6
    input x[X]
    param W[4*H, X], U[4*H, H], b[4*H]
    state h[H], c[H]
    root {
        g = W @ x + b
        c = sigmoid(g[0:H]) * tanh(g[2*H:3*H])
        h = sigmoid(g[3*H:4*H]) * tanh(c)
    }
    node {
        g = W @ x + U @ parent.h + b
        c = sigmoid(g[0:H]) * tanh(g[2*H:3*H]) + sigmoid(g[H:2*H]) * parent.c
        h = sigmoid(g[3*H:4*H]) * tanh(c)
    }
    output top[H] at root = tanh(h)
}
"""

#: a DAG read from its parents: their mean and their max (roots run `node` with no parent: both 0)
DAG_DOWN = """
cell DagDown on dag down {
    dim X = 4, H = 5
    input x[X]
    param W[H, X], U[H, H], V[H, H], b[H]
    state h[H]
    node { h = tanh(W @ x + mean(U @ parent.h) + V @ max(parent.h) + sum(1) * b) }
    output y[H] = h * 2
}
"""


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("down")
    built = {}
    for name, text in (("lstm", DOWN_LSTM), ("dag", DAG_DOWN)):
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
    return {
        "shuffled": shuffled_ids(Forest.random(6, rng=rng, max_children=4, max_nodes=15), rng),
        "chain": Forest.from_parents([1, 2, 3, -1]),
        "single": Forest.from_parents([-1]),
        "concat": Forest.concat([Forest.from_parents([-1]), Forest.random(4, rng=rng, max_nodes=9)]),
    }


def _parents_of(forest: Forest, node: int) -> list[int]:
    """The nodes that have `node` as a child, in increasing id order, from the forest's own edge arrays."""
    return sorted(int(p) for p in forest.edge_parent[forest.edge_child == node])


def _root_first(forest: Forest) -> list[int]:
    """Every node after its parents (a plain topological sort of the reversed edges, written here)."""
    done: list[int] = []
    placed: set[int] = set()
    while len(done) < forest.num_nodes:
        for node in range(forest.num_nodes):
            if node not in placed and all(p in placed for p in _parents_of(forest, node)):
                done.append(node)
                placed.add(node)
    return done


def _lstm_reference(forest: Forest, p: dict, x) -> dict:
    H = p["b"].shape[0] // 4
    hs, cs = {}, {}
    for node in _root_first(forest):
        (parent,) = _parents_of(forest, node) or [None]
        g = p["W"] @ x[node] + p["b"]
        if parent is not None:
            g = g + p["U"] @ hs[parent]
        c = torch.sigmoid(g[:H]) * torch.tanh(g[2 * H : 3 * H])
        if parent is not None:
            c = c + torch.sigmoid(g[H : 2 * H]) * cs[parent]
        hs[node], cs[node] = torch.sigmoid(g[3 * H :]) * torch.tanh(c), c
    h = torch.stack([hs[i] for i in range(forest.num_nodes)])
    roots = [int(r) for r in forest.roots]
    return {"h": h, "c": torch.stack([cs[i] for i in range(forest.num_nodes)]), "top": torch.tanh(h[roots])}


def _dag_reference(forest: Forest, p: dict, x) -> dict:
    H = p["b"].shape[0]
    hs = {}
    for node in _root_first(forest):
        parents = _parents_of(forest, node)
        total = p["W"] @ x[node] + len(parents) * p["b"]
        if parents:
            total = total + sum(p["U"] @ hs[q] for q in parents) / len(parents)
            total = total + p["V"] @ torch.stack([hs[q] for q in parents]).max(dim=0).values
        else:
            total = total + torch.zeros(H, dtype=torch.float64)
        hs[node] = torch.tanh(total)
    h = torch.stack([hs[i] for i in range(forest.num_nodes)])
    return {"h": h, "y": h * 2}


REFERENCES = {"lstm": ("DownLSTM", _lstm_reference), "dag": ("DagDown", _dag_reference)}


def _check(model, forest: Forest, reference, x: np.ndarray, rng: np.random.Generator, what: str) -> None:
    params = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in model.params.items()}
    x64 = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    expected = reference(forest, params, x64)
    out = model(forest, grad=True, x=x)
    for name, value in expected.items():
        assert relative_error(out[name], value.detach().numpy()) < 1e-5, f"{what}: {name}"
    upstream = {name: rng.standard_normal(value.shape) for name, value in expected.items()}
    sum((value * torch.tensor(upstream[name])).sum() for name, value in expected.items()).backward()
    grads = model.backward(out, {k: v.astype(np.float32) for k, v in upstream.items()})
    for name, leaf in {**params, "x": x64}.items():
        want = np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.numpy()
        assert relative_error(grads[name], want) < 1e-5, f"{what}: d{name}"


def _model(module, name: str, device: str, seed: int):
    model = getattr(module, name)(device=device, seed=seed)
    rng = np.random.default_rng(seed)
    model.load_params({k: v + (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()})
    return model


CASES = [("dag", "dag"), ("dag", "concat"), *(("lstm", s) for s in ("shuffled", "chain", "single", "concat"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "shape"), CASES)
def test_down_cells_match_per_node_torch(modules, device, kind, shape):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh every run; in the message on failure
    name, reference = REFERENCES[kind]
    model = _model(modules[kind], name, device, seed)
    forest = _forests(kind, seed)[shape]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((forest.num_nodes, 4)).astype(np.float32)
    _check(model, forest, reference, x, rng, f"{device} {shape} seed {seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_down_on_sst_trees(modules, device):
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    forest = Forest.from_ptb(lines[:20])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((forest.num_nodes, 4)).astype(np.float32)
    _check(_model(modules["lstm"], "DownLSTM", device, 1), forest, _lstm_reference, x, rng, f"SST {device}")


@pytest.mark.parametrize("device", DEVICES)
def test_down_on_a_chain_is_an_lstm_over_the_flipped_sequence(modules, device):
    """A chain's root is its last node: the down cell runs it first, as torch.nn.LSTM runs the flipped x."""
    n, X, H = 9, 4, 6
    model = _model(modules["lstm"], "DownLSTM", device, 5)
    forest = Forest.from_parents([*range(1, n), -1])
    x = np.random.default_rng(2).standard_normal((n, X)).astype(np.float32)
    lstm = torch.nn.LSTM(X, H, dtype=torch.float64)
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.tensor(model.params["W"]))
        lstm.weight_hh_l0.copy_(torch.tensor(model.params["U"]))
        lstm.bias_ih_l0.copy_(torch.tensor(model.params["b"]))
        lstm.bias_hh_l0.zero_()
        flipped, _ = lstm(torch.tensor(x[::-1].copy(), dtype=torch.float64))
    assert relative_error(model(forest, x=x)["h"], flipped.numpy()[::-1]) < 1e-5


def test_the_reversed_forest_reads_parents_in_increasing_id_order():
    forest = Forest.random_dag(30, rng=np.random.default_rng(4), max_parents=4)
    turned = reversed_forest(forest)
    for node in range(forest.num_nodes):
        assert list(turned.children(node)) == _parents_of(forest, node)
    lin = linearize_down(forest)
    assert list(lin.roots) == list(forest.roots)
    first_level = set(lin.level_order[: lin.level_ptr[1]].tolist())
    assert first_level == {n for n in range(forest.num_nodes) if not _parents_of(forest, n)}


def _cell(header: str, blocks: str) -> str:
    return f"cell E on {header} {{\n    dim H = 3\n    input x[H]\n    state h[H]\n    {blocks}\n}}\n"


ERRORS = [
    ("tree", "node { h = tanh(x + parent.h) }", "parent.h in a bottom-up cell", "parent.h"),
    ("tree", "root { h = x }\n    node { h = tanh(x + sum(child.h)) }", "a root block in a bottom-up cell", "root {"),
    ("tree down", "leaf { h = x }\n    node { h = tanh(x + parent.h) }", "a leaf block in a down cell", "leaf {"),
    ("tree down", "node { h = tanh(x + sum(parent.h)) }", "sum(...) in a down cell on a tree", "sum("),
    ("dag down", "node { h = tanh(x + sum(child.h)) }", "child.h in a down cell", "child.h"),
    ("tree(arity = 2) down", "node { h = tanh(x + child[0].h) }", "child[0].h in a down cell", "child[0]"),
    ("dag down", "node { h = tanh(x + sum(child_softmax(parent.h) * parent.h)) }", "child_softmax in a down", "child_"),
    ("tree down", "root { h = tanh(parent.h) }\n    node { h = x }", "parent.h in the root block", "parent.h"),
    ("tree down", "node { h = tanh(x + parent.c) }", "the parents have no state 'c'", "parent.c"),
    (
        "tree(arity = 2) down",
        "node { h = tanh(x + edge[0].position * parent.h) }",
        "edge[0].position in a down",
        "edge[",
    ),
    (
        "tree down",
        "root { h = tanh(x * edge.siblings) }\n    node { h = x }",
        "edge.siblings in the root block",
        "edge.",
    ),
    ("tree down", "node { h = tanh(x * edge.parent_count) }", "unknown edge value 'parent_count'", "edge."),
]


@pytest.mark.parametrize(("header", "blocks", "message", "at"), ERRORS, ids=[e[2][:32] for e in ERRORS])
def test_down_errors_are_located(header, blocks, message, at):
    source = _cell(header, blocks)
    with pytest.raises(CellTypeError) as err:
        lower_source(source, "e.cell")
    text = str(err.value)
    assert message in text, text
    line = next(n for n, line in enumerate(source.splitlines(), 1) if at in line)
    assert text.startswith(f"e.cell:{line}:{source.splitlines()[line - 1].index(at) + 1}:"), text


@pytest.mark.parametrize("word", ["down", "parent"])
def test_the_new_keywords_cannot_be_names(word):
    with pytest.raises(CellSyntaxError, match=f"'{word}' is a keyword from Version 3"):
        lower_source(_cell("tree", f"node {{ {word} = x\n h = tanh({word}) }}"), "e.cell")


WORKER = r"""
import json, sys
import numpy as np
import cortexc
from cortexc import Forest
module = cortexc.load(sys.argv[1], out_dir=sys.argv[2])
model = module.DownLSTM(device="cpu", seed=3)
rng = np.random.default_rng(5)
forest = Forest.random(60, rng=rng, max_children=5, max_nodes=40)
x = rng.standard_normal((forest.num_nodes, 4)).astype(np.float32)
out = model(forest, grad=True, x=x)
grads = model.backward(out, {"h": np.ones_like(out["h"]), "top": np.ones_like(out["top"])})
from tests.helpers import digest  # the worker runs in the checkout
print(json.dumps(digest({**out, **{f"d_{name}": value for name, value in grads.items()}})))
"""


@pytest.mark.slow
def test_one_and_two_threads_give_the_same_bits(tmp_path):
    digests = digests_at_thread_counts(WORKER, DOWN_LSTM, tmp_path)
    assert digests[0] == digests[1]


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_down_cells_compile_with_nvcc_without_spills(modules):
    assert_packages_compile_with_nvcc_without_spills(modules.values())


# --------------------------------------------------------------------------- the edge to the parent


#: the spec's top-down Tree-LSTM (Teng & Zhang 2017): left and right children get their own recurrent weights,
#: chosen by the node's place under its parent; plus an edge input and the parent's number of children
POSITIONS = """
cell TopDown on tree(arity = 2) down {
    dim X = 4, H = 5
    input x[X]
    input w[2] on edge
    param W[4*H, X], U[2, 4*H, H], V[4*H, 2], b[4*H], s[4*H]
    state h[H], c[H]
    root {
        g = W @ x + b
        c = sigmoid(g[0:H]) * tanh(g[2*H:3*H])
        h = sigmoid(g[3*H:4*H]) * tanh(c)
    }
    node {
        g = W @ x + U[edge.position] @ parent.h + V @ edge.w + edge.siblings * s + b
        c = sigmoid(g[0:H]) * tanh(g[2*H:3*H]) + sigmoid(g[H:2*H]) * parent.c
        h = sigmoid(g[3*H:4*H]) * tanh(c)
    }
}
"""

#: a DAG read from its parents through typed edges: a matrix per relation and per position, an edge feature
DAG_EDGES = """
cell DagEdges on dag down {
    dim X = 4, H = 5, R = 3
    input x[X]
    input rel : index[R] on edge
    input w[1] on edge
    param W[H, X], U[R, H, H], P[4, H, H], b[H]
    state h[H]
    node {
        h = tanh(W @ x + sum(U[edge.rel] @ parent.h) + 0.5 * sum(P[edge.position] @ parent.h)
                 + sum(edge.w * parent.h) + sum(edge.siblings) * b)
    }
}
"""


@pytest.fixture(scope="module")
def edge_modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("down_edges")
    built = {}
    for name, text in (("positions", POSITIONS), ("dag", DAG_EDGES)):
        path = out / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        built[name] = cortexc.load(path, out_dir=out / name)
    return built


def _edge_to(forest: Forest, parent: int, node: int) -> tuple[int, int, int]:
    """(edge number, the node's place under the parent, the parent's number of children), from the forest."""
    start = int(forest.edge_ptr[parent])
    place = [int(c) for c in forest.children(parent)].index(node)
    return start + place, place, int(forest.num_children[parent])


def _positions_reference(forest: Forest, p: dict, x, w) -> dict:
    H = p["b"].shape[0] // 4
    hs, cs = {}, {}
    for node in _root_first(forest):
        (parent,) = _parents_of(forest, node) or [None]
        g = p["W"] @ x[node] + p["b"]
        if parent is not None:
            e, place, siblings = _edge_to(forest, parent, node)
            g = g + p["U"][place] @ hs[parent] + p["V"] @ w[e] + siblings * p["s"]
        c = torch.sigmoid(g[:H]) * torch.tanh(g[2 * H : 3 * H])
        if parent is not None:
            c = c + torch.sigmoid(g[H : 2 * H]) * cs[parent]
        hs[node], cs[node] = torch.sigmoid(g[3 * H :]) * torch.tanh(c), c
    order = range(forest.num_nodes)
    return {"h": torch.stack([hs[i] for i in order]), "c": torch.stack([cs[i] for i in order])}


def _dag_edges_reference(forest: Forest, p: dict, x, rel, w) -> dict:
    hs = {}
    for node in _root_first(forest):
        total = p["W"] @ x[node]
        for parent in _parents_of(forest, node):
            e, place, siblings = _edge_to(forest, parent, node)
            total = total + p["U"][int(rel[e])] @ hs[parent] + 0.5 * (p["P"][place] @ hs[parent])
            total = total + w[e] * hs[parent] + siblings * p["b"]
        hs[node] = torch.tanh(total)
    return {"h": torch.stack([hs[i] for i in range(forest.num_nodes)])}


def _edge_forests(kind: str, seed: int) -> dict[str, Forest]:
    rng = np.random.default_rng(seed)
    if kind == "dag":
        return {"dag": Forest.random_dag(40, rng=rng, max_children=4, max_parents=3)}
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    binary = shuffled_ids(Forest.random(6, rng=rng, binary=True, max_nodes=15), rng)
    return {
        "shuffled": binary,
        "single": Forest.from_parents([-1]),
        "sst": Forest.from_ptb(lines[10:22]),
        "concat": Forest.concat([Forest.from_parents([-1]), binary, Forest.from_parents([2, 2, -1])]),
    }


EDGE_CASES = [("dag", "dag"), *(("positions", s) for s in ("shuffled", "single", "sst", "concat"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "shape"), EDGE_CASES)
def test_down_cells_read_the_edge_to_their_parent(edge_modules, device, kind, shape):
    """Positions, sibling counts and edge inputs of the edge to each parent, and matrices chosen by them."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    name = "TopDown" if kind == "positions" else "DagEdges"
    model = _model(edge_modules[kind], name, device, seed)
    forest = _edge_forests(kind, seed)[shape]
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.standard_normal((forest.num_nodes, 4)).astype(np.float32)}
    if kind == "positions":
        inputs["w"] = rng.standard_normal((forest.num_edges, 2)).astype(np.float32)
    else:
        inputs["rel"] = rng.integers(0, 3, forest.num_edges).astype(np.int32)
        inputs["w"] = rng.standard_normal((forest.num_edges, 1)).astype(np.float32)
    params = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in model.params.items()}
    floats = {k: torch.tensor(np.asarray(inputs[k], np.float64), requires_grad=True) for k in ("x", "w")}
    if kind == "positions":
        expected = _positions_reference(forest, params, floats["x"], floats["w"])
    else:
        expected = _dag_edges_reference(forest, params, floats["x"], inputs["rel"], floats["w"])
    out = model(forest, grad=True, **inputs)
    what = f"{device} {shape} seed {seed}"
    for key, value in expected.items():
        assert relative_error(out[key], value.detach().numpy()) < 1e-5, f"{what}: {key}"
    upstream = {key: rng.standard_normal(value.shape) for key, value in expected.items()}
    sum((value * torch.tensor(upstream[key])).sum() for key, value in expected.items()).backward()
    grads = model.backward(out, {k: v.astype(np.float32) for k, v in upstream.items()})
    assert set(grads) == set(params) | set(floats)  # nothing of the runtime's own edge inputs
    for key, leaf in {**params, **floats}.items():
        want = np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.numpy()
        assert relative_error(grads[key], want) < 1e-5, f"{what}: d{key}"


def test_the_runtimes_edge_inputs_are_not_the_callers(edge_modules):
    model = edge_modules["positions"].TopDown(device="cpu")
    assert {i.name for i in model.signature.inputs if i.given_by} == {"_edge_position", "_edge_siblings"}
    forest = Forest.from_parents([2, 2, -1])
    inputs = {"x": np.zeros((3, 4), np.float32), "w": np.zeros((2, 2), np.float32)}
    with pytest.raises(CortexcError, match="has no input '_edge_position'"):
        model(forest, **inputs, _edge_position=np.zeros((2, 1), np.float32))
    with pytest.raises(CellTypeError, match="an input cannot be named '_edge_siblings'"):
        lower_source(
            _cell("tree down", "node { h = x }").replace("input x[H]", "input x[H], _edge_siblings[1]"), "e.cell"
        )
