"""The reference interpreter against independent references.

`cortexc.ir.interp` is the oracle for every compiled path, so here it is checked
against code that shares nothing with it: per-node NumPy written from the math
of each model (one child at a time, recursion over our own parent arrays),
`torch.nn.LSTM`, and hand computations. Structure is derived from our own
parent arrays (and our own PTB reader for SST), never from the Forest under test.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from cortexc import reference
from cortexc.errors import ForestError, InputError
from cortexc.frontend import lower_source
from cortexc.ir import interp
from cortexc.runtime.forest import Forest
from cortexc.runtime.params import check_params, init_params
from tests.helpers import EXAMPLES, children_of, random_inputs, relative_error, sst_path

RTOL = {np.float32: 1e-5, np.float64: 1e-12}
SST_TREES = 150


# ----------------------------------------------------------------- helpers


def load(name: str, **defines: int):
    path = EXAMPLES / name
    return lower_source(path.read_text(), str(path), defines=defines)[0]


def cell_of(source: str, **defines: int):
    return lower_source(source, "inline.cell", defines=defines or None)[0]


def rand_params(cell, rng, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Every param random (biases too, unlike the declared inits), float64."""
    return {d.name: rng.normal(0.0, scale, d.shape) for d in cell.params}


def as_dtype(arrays: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    return {k: (v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v) for k, v in arrays.items()}


def assert_close(got, ref, dtype, what: str) -> None:
    """Normwise relative error within RTOL[dtype] (printed for the record), shapes equal."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype}, expected {np.dtype(dtype)}"
    err = relative_error(got, ref)
    print(f"relerr[{what}, {np.dtype(dtype).name}] = {err:.3g}")
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, ref, rtol=RTOL[dtype], atol=RTOL[dtype] * scale, err_msg=what)


def ref_run(children: list[list[int]], node_fn) -> list:
    """node_fn(i, [result of each child, in order]) for every node, each computed once, memoised."""
    out: list = [None] * len(children)

    def visit(i):
        if out[i] is None:
            out[i] = node_fn(i, [visit(k) for k in children[i]])
        return out[i]

    for i in range(len(children)):
        visit(i)
    return out


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def relabel(parents, perm) -> np.ndarray:
    """The same forest with node i renamed perm[i] (so indices need not be children-first)."""
    parents = np.asarray(parents)
    new = np.full(len(parents), -1, np.int64)
    for i, p in enumerate(parents):
        new[perm[i]] = -1 if p < 0 else perm[p]
    return new


def random_recursive_parents(rng, n: int, max_children: int | None = None) -> np.ndarray:
    """Node 0 is the root, node k hangs under a random earlier node with room left."""
    parents = np.full(n, -1, np.int64)
    counts = np.zeros(n, np.int64)
    for k in range(1, n):
        room = np.flatnonzero(counts[:k] < (max_children or n))
        p = int(rng.choice(room))
        parents[k] = p
        counts[p] += 1
    return parents


def nested_to_parents(tree) -> tuple[list[int], list]:
    """Post-order numbering (children first, left to right) of nested tuples; leaves are payloads."""
    parents: list[int] = []
    leaves: list = []

    def walk(t) -> int:
        kids = [walk(c) for c in t] if isinstance(t, tuple) else []
        me = len(parents)
        parents.append(-1)
        leaves.append(None if isinstance(t, tuple) else t)
        for k in kids:
            parents[k] = me
        return me

    walk(tree)
    return parents, leaves


def random_binary(rng, leaves: int, counter: list[int] | None = None):
    counter = counter if counter is not None else [0]
    if leaves == 1:
        counter[0] += 1
        return counter[0]
    left = int(rng.integers(1, leaves))
    return (random_binary(rng, left, counter), random_binary(rng, leaves - left, counter))


def join_forests(parts: list[np.ndarray], rng=None) -> np.ndarray:
    """Several parent arrays as one, optionally with the node ids shuffled across trees."""
    offsets = np.cumsum([0] + [len(p) for p in parts])
    joined = np.concatenate([np.where(p >= 0, p + off, -1) for p, off in zip(parts, offsets)])
    return joined if rng is None else relabel(joined, rng.permutation(len(joined)))


def tree_shape(name: str, rng) -> np.ndarray:
    if name == "single":
        return np.array([-1])
    if name == "chain":  # node i's parent is i+1
        return np.append(np.arange(1, 12), -1)
    if name == "chain_reversed":  # node i's parent is i-1: the root is node 0
        return np.arange(-1, 11)
    if name == "wide":  # a root with 7 children, one of which has 5, one of those 6
        tree = (1, 2, (3, 4, 5, (6, 7, 8, 9, 10, 11), 12), 13, 14, 15, 16)
        parents = np.array(nested_to_parents(tree)[0])
        return relabel(parents, rng.permutation(len(parents)))
    if name == "random":
        parents = random_recursive_parents(rng, 40)
        return relabel(parents, rng.permutation(40))
    if name == "forest":
        parts = [random_recursive_parents(rng, int(n)) for n in (1, 9, 23, 4, 15)]
        return join_forests(parts, rng)
    raise ValueError(name)


TREE_SHAPES = ["single", "chain", "chain_reversed", "wide", "random", "forest"]


def read_ptb(lines: list[str]) -> tuple[np.ndarray, list]:
    """Our own PTB reader: post-order per tree, trees in order; words on leaves, None elsewhere."""
    parents: list[int] = []
    words: list = []

    def node(toks: list[str], pos: int) -> tuple[int, int]:
        """Read the node starting at toks[pos]; its id and the position after it."""
        assert toks[pos] == "("
        pos += 2  # "(" and the label
        kids, word = [], None
        if toks[pos] == "(":
            while toks[pos] == "(":
                kid, pos = node(toks, pos)
                kids.append(kid)
        else:
            word = toks[pos]
            pos += 1
        assert toks[pos] == ")"
        me = len(parents)
        parents.append(-1)
        words.append(word)
        for k in kids:
            parents[k] = me
        return me, pos + 1

    for line in lines:
        toks = re.findall(r"\(|\)|[^ ()\n]+", line)
        if toks:
            assert node(toks, 0)[1] == len(toks)
    return np.array(parents, np.int64), words


@pytest.fixture(scope="module")
def sst_dev():
    """The first SST_TREES dev trees: the Forest and our own reading of them (which must agree)."""
    with open(sst_path("dev"), encoding="utf-8") as handle:
        lines = [line for _, line in zip(range(SST_TREES), handle)]
    forest = Forest.from_ptb(lines)
    parents, words = read_ptb(lines)
    assert forest.num_trees == SST_TREES and forest.num_nodes == len(parents)
    np.testing.assert_array_equal(forest.parents, parents)
    assert forest.words == words
    return forest, parents, words


# ------------------------------------------------------ 1. child-sum Tree-LSTM


def treelstm_reference(params, x, parents):
    P = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    H = P["b_f"].shape[0]

    def node(i, kids):
        h_sum = np.zeros(H)
        for h_k, _ in kids:
            h_sum = h_sum + h_k
        iou = P["W_iou"] @ x[i] + P["U_iou"] @ h_sum + P["b_iou"]
        gate_i, gate_o, u = sigmoid(iou[:H]), sigmoid(iou[H : 2 * H]), np.tanh(iou[2 * H :])
        c = gate_i * u
        for h_k, c_k in kids:
            f_k = sigmoid(P["W_f"] @ x[i] + P["U_f"] @ h_k + P["b_f"])
            c = c + f_k * c_k
        return gate_o * np.tanh(c), c

    states = ref_run(children_of(parents), node)
    return np.array([s[0] for s in states]), np.array([s[1] for s in states])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_treelstm_random_trees(shape, dtype, rng):
    cell = load("treelstm.cell", X=16, H=12)
    parents = tree_shape(shape, rng)
    forest = Forest.from_parents(parents)
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((forest.num_nodes, 16)).astype(dtype)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    h, c = treelstm_reference(params, x, parents)
    assert_close(out["h"], h, dtype, f"treelstm h {shape}")
    assert_close(out["c"], c, dtype, f"treelstm c {shape}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_treelstm_sst(sst_dev, dtype, rng):
    forest, parents, _ = sst_dev
    cell = load("treelstm.cell", X=16, H=12)
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((forest.num_nodes, 16)).astype(dtype)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    h, c = treelstm_reference(params, x, parents)
    assert_close(out["h"], h, dtype, "treelstm h sst")
    assert_close(out["c"], c, dtype, "treelstm c sst")


def test_treelstm_declared_init_runs(rng):
    """With init_params (zero biases) and float32 as the compiled code uses."""
    cell = load("treelstm.cell", X=16, H=12)
    forest = Forest.from_parents(tree_shape("forest", rng))
    params = init_params(cell, int(rng.integers(1 << 30)))
    inputs = random_inputs(cell, forest, rng)
    out = reference.run(cell, forest, params, inputs)
    h, c = treelstm_reference(params, inputs["x"], forest.parents)
    assert_close(out["h"], h, np.float32, "treelstm h init_params")
    assert_close(out["c"], c, np.float32, "treelstm c init_params")


# ------------------------------------------------------ 2. binary Tree-LSTM, at root


def binary_treelstm_reference(P, word, parents):
    P = {k: np.asarray(v, np.float64) for k, v in P.items()}
    H = P["W_s"].shape[1]
    zero = np.zeros(H)

    def node(i, kids):
        if not kids:
            iou = P["W_iou"] @ P["E"][word[i]] + P["b_iou"]
            c = sigmoid(iou[:H]) * np.tanh(iou[2 * H :])
            return sigmoid(iou[H : 2 * H]) * np.tanh(c), c
        (h0, c0), (h1, c1) = (kids + [(zero, zero)])[:2]
        hc = np.concatenate([h0, h1])
        iou = P["U_iou"] @ hc + P["b_iou"]
        f = sigmoid(P["U_f"] @ hc + P["b_f"])
        c = sigmoid(iou[:H]) * np.tanh(iou[2 * H :]) + f[:H] * c0 + f[H:] * c1
        return sigmoid(iou[H : 2 * H]) * np.tanh(c), c

    states = ref_run(children_of(parents), node)
    h = np.array([s[0] for s in states])
    c = np.array([s[1] for s in states])
    return h, c, h @ P["W_s"].T + P["b_s"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binary_treelstm_sst(sst_dev, dtype, rng):
    forest, parents, words = sst_dev
    vocab = {"<pad>": 0}
    for w in words:
        if w is not None:
            vocab.setdefault(w, len(vocab))
    word = np.array([vocab[w] if w is not None else 0 for w in words], np.int32)
    cell = load("binary_treelstm.cell", V=len(vocab), X=8, H=6)
    params = as_dtype(rand_params(cell, rng), dtype)
    out = reference.run(cell, forest, params, {"word": word}, dtype=dtype)
    h, c, logits = binary_treelstm_reference(params, word, parents)
    assert out["logits"].shape == (forest.num_nodes, 5)
    assert_close(out["h"], h, dtype, "binary treelstm h sst")
    assert_close(out["c"], c, dtype, "binary treelstm c sst")
    assert_close(out["logits"], logits, dtype, "binary treelstm logits sst")


ROOT_CELL = """
cell RootPool on tree {
    dim X = 4, C = 3
    input x[X]
    param W[C, X], b[C]
    state s[X]
    node { s = x + sum(child.s) }
    output total[C] at root = softmax(W @ s + b)
    output every[C] = W @ s - x[0:C]
}
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_at_root(dtype, rng):
    cell = cell_of(ROOT_CELL)
    parts = [random_recursive_parents(rng, int(n)) for n in (5, 1, 12, 3, 8)]
    parents = join_forests(parts, rng)  # roots scattered through the numbering
    forest = Forest.from_parents(parents)
    roots = np.flatnonzero(parents == -1)
    np.testing.assert_array_equal(forest.roots, roots)  # increasing node order
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((len(parents), 4)).astype(dtype)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)

    s = np.array(ref_run(children_of(parents), lambda i, kids: x[i].astype(np.float64) + sum(kids)))
    W, b = params["W"].astype(np.float64), params["b"].astype(np.float64)
    logits = s[roots] @ W.T + b
    total = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert out["total"].shape == (5, 3)
    assert_close(out["s"], s, dtype, "root pool s")
    assert_close(out["total"], total, dtype, "root pool total (at root)")
    assert_close(out["every"], s @ W.T - x[:, :3], dtype, "root pool every")


# ------------------------------------------------------ 3. chain LSTM vs torch


def torch_lstm_run(torch, params, x, dtype):
    """h at every step and c at every step (nn.LSTM for h, nn.LSTMCell steps for c)."""
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    X, H = params["W_ih"].shape[1], params["W_hh"].shape[1]
    lstm = torch.nn.LSTM(X, H).to(tdtype)
    step = torch.nn.LSTMCell(X, H).to(tdtype)
    with torch.no_grad():
        for module, suffix in ((lstm, "_l0"), (step, "")):
            getattr(module, "weight_ih" + suffix).copy_(torch.from_numpy(params["W_ih"]))
            getattr(module, "weight_hh" + suffix).copy_(torch.from_numpy(params["W_hh"]))
            getattr(module, "bias_ih" + suffix).copy_(torch.from_numpy(params["b_ih"]))
            getattr(module, "bias_hh" + suffix).copy_(torch.from_numpy(params["b_hh"]))
        xs = torch.from_numpy(np.ascontiguousarray(x))
        out, (h_n, c_n) = lstm(xs[:, None, :])
        h_t, c_t = torch.zeros(1, H, dtype=tdtype), torch.zeros(1, H, dtype=tdtype)
        cs = []
        for t in range(len(x)):
            h_t, c_t = step(xs[t : t + 1], (h_t, c_t))
            cs.append(c_t[0])
    hs = out[:, 0, :].numpy()
    # the two torch paths agree up to float rounding (different kernels): relative to the values' scale
    for ours, theirs in ((hs[-1], h_n[0, 0].numpy()), (cs[-1].numpy(), c_n[0, 0].numpy())):
        tolerance = RTOL[dtype] * max(float(np.abs(theirs).max()), 1.0)
        assert np.allclose(ours, theirs, rtol=RTOL[dtype], atol=tolerance)
    return hs, torch.stack(cs).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", [1, 7, 30])
def test_lstm_chain_vs_torch(length, dtype, rng):
    torch = pytest.importorskip("torch")
    cell = load("lstm.cell", X=5, H=7)
    parents = np.append(np.arange(1, length), -1)  # node i's parent is i+1
    forest = Forest.from_parents(parents)
    assert forest.num_children[0] == 0 and list(forest.roots) == [length - 1]  # node 0 is step 0
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((length, 5)).astype(dtype)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    hs, cs = torch_lstm_run(torch, params, x, dtype)
    assert_close(out["h"], hs, dtype, f"lstm h T={length}")
    assert_close(out["c"], cs, dtype, f"lstm c T={length}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lstm_batched_chains_vs_torch(dtype, rng):
    torch = pytest.importorskip("torch")
    cell = load("lstm.cell", X=5, H=7)
    lengths = [1, 7, 30, 4, 12]
    n = sum(lengths)
    ids = rng.permutation(n)  # chains interleaved in the numbering
    chains, parents, start = [], np.full(n, -1, np.int64), 0
    for length in lengths:
        chain = ids[start : start + length]  # chain[t] is step t
        parents[chain[:-1]] = chain[1:]
        chains.append(chain)
        start += length
    forest = Forest.from_parents(parents)
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((n, 5)).astype(dtype)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    for chain in chains:
        hs, cs = torch_lstm_run(torch, params, x[chain], dtype)
        assert_close(out["h"][chain], hs, dtype, f"lstm batched h T={len(chain)}")
        assert_close(out["c"][chain], cs, dtype, f"lstm batched c T={len(chain)}")


# ------------------------------------------------------ 4. DAG


def count_evals(monkeypatch) -> dict[int, int]:
    counts: dict[int, int] = {}
    original = interp.eval_body

    def counting(body, node):
        counts[node.index] = counts.get(node.index, 0) + 1
        return original(body, node)

    monkeypatch.setattr(interp, "eval_body", counting)
    return counts


def test_dagrnn_shared_node_by_hand(monkeypatch, rng):
    nx = pytest.importorskip("networkx")
    cell = load("dagrnn.cell", X=3, H=4)
    G = nx.DiGraph()
    G.add_nodes_from(["root", "p1", "p2", "shared", "a", "b"])  # parents numbered first
    G.add_edges_from([("shared", "p1"), ("a", "p1"), ("b", "p2"), ("shared", "p2"), ("p1", "root"), ("p2", "root")])
    forest = Forest.from_networkx(G)
    idx = {name: i for i, name in enumerate(G.nodes)}
    assert not forest.is_tree
    assert list(forest.roots) == [idx["root"]]
    params = rand_params(cell, rng)
    x = rng.standard_normal((6, 3))
    counts = count_evals(monkeypatch)
    out = reference.run(cell, forest, params, {"x": x}, dtype=np.float64)
    assert counts == {i: 1 for i in range(6)}  # every node, the shared one included, exactly once

    W, U, b = params["W"], params["U"], params["b"]

    def leaf(name):
        return np.tanh(W @ x[idx[name]] + b)

    h_shared, h_a, h_b = leaf("shared"), leaf("a"), leaf("b")
    h_p1 = np.tanh(W @ x[idx["p1"]] + U @ h_shared + U @ h_a + b)
    h_p2 = np.tanh(W @ x[idx["p2"]] + U @ h_b + U @ h_shared + b)
    h_root = np.tanh(W @ x[idx["root"]] + U @ h_p1 + U @ h_p2 + b)
    expected = np.zeros((6, 4))
    for name, h in [("shared", h_shared), ("a", h_a), ("b", h_b), ("p1", h_p1), ("p2", h_p2), ("root", h_root)]:
        expected[idx[name]] = h
    assert_close(out["h"], expected, np.float64, "dagrnn by hand")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dagrnn_random_dag(monkeypatch, dtype, rng):
    nx = pytest.importorskip("networkx")
    cell = load("dagrnn.cell", X=6, H=5)
    n = 60
    created = [f"n{k}" for k in range(n)]  # n_k may read earlier-created nodes
    G = nx.DiGraph()
    G.add_nodes_from(rng.permutation(created).tolist())
    for k in range(1, n):
        for j in rng.choice(k, size=int(rng.integers(0, min(k, 4) + 1)), replace=False):
            G.add_edge(created[j], created[k])
    names = list(G.nodes)
    idx = {name: i for i, name in enumerate(names)}
    children = [[idx[p] for p in G.predecessors(name)] for name in names]
    assert any(G.out_degree(v) > 1 for v in names)
    forest = Forest.from_networkx(G)
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((n, 6)).astype(dtype)
    counts = count_evals(monkeypatch)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    assert counts == {i: 1 for i in range(n)}
    P = {k: v.astype(np.float64) for k, v in params.items()}
    h = ref_run(children, lambda i, kids: np.tanh(P["W"] @ x[i] + sum(P["U"] @ k for k in kids) + P["b"]))
    assert_close(out["h"], np.array(h), dtype, "dagrnn random dag")


DAG2_CELL = """
cell Dag2 on dag(arity = 2) {
    dim H = 2
    input x[H]
    state h[H]
    node { h = x + 2 * child[0].h - child[1].h }
}
"""


def test_dag_arity_child_positions(monkeypatch, rng):
    """A shared node is child 0 of one reader and child 1 of another; missing child[1] reads 0."""
    nx = pytest.importorskip("networkx")
    G = nx.DiGraph()
    G.add_nodes_from(["top", "p", "q", "s", "t"])
    G.add_edges_from([("s", "p"), ("t", "q"), ("s", "q"), ("p", "top"), ("q", "top")])
    forest = Forest.from_networkx(G)
    np.testing.assert_array_equal(forest.children(2), [4, 3])  # q reads t first, then s
    x = rng.standard_normal((5, 2))
    counts = count_evals(monkeypatch)
    out = reference.run(cell_of(DAG2_CELL), forest, {}, {"x": x}, dtype=np.float64)
    assert counts == {i: 1 for i in range(5)}
    top, p, q, s, t = x
    h_s, h_t = s, t
    h_p = p + 2 * h_s  # one child: child[1] reads 0
    h_q = q + 2 * h_t - h_s
    h_top = top + 2 * h_p - h_q
    assert_close(out["h"], np.array([h_top, h_p, h_q, h_s, h_t]), np.float64, "dag arity 2 by hand")


# ------------------------------------------------------ 5. MV-RNN


def test_mvrnn(rng):
    cell = load("mvrnn.cell", X=5, H=4)
    tree = random_binary(rng, 9)
    parents, _ = nested_to_parents(tree)
    parents = np.array(parents)
    forest = Forest.from_parents(parents)
    N = len(parents)
    params = rand_params(cell, rng)
    x = rng.standard_normal((N, 5))
    out = reference.run(cell, forest, params, {"x": x}, dtype=np.float64)
    assert out["h"].shape == (N, 4) and out["A"].shape == (N, 4, 4)
    kids = children_of(parents)
    leaves = [i for i in range(N) if not kids[i]]
    for i in leaves:
        assert np.array_equal(out["A"][i], params["A0"])  # exactly, no arithmetic on A0
        assert_close(out["h"][i], np.tanh(params["W_x"] @ x[i] + params["b"]), np.float64, "mvrnn leaf h")
    # one internal node whose children are both leaves, by hand
    i = next(i for i in range(N) if len(kids[i]) == 2 and all(not kids[k] for k in kids[i]))
    left, right = kids[i]
    A0 = params["A0"]
    h_l = np.tanh(params["W_x"] @ x[left] + params["b"])
    h_r = np.tanh(params["W_x"] @ x[right] + params["b"])
    h = np.tanh(params["W"] @ np.concatenate([A0 @ h_l, A0 @ h_r]) + params["b"])
    A = params["W_M"] @ np.vstack([A0, A0])
    assert_close(out["h"][i], h, np.float64, "mvrnn internal h by hand")
    assert_close(out["A"][i], A, np.float64, "mvrnn internal A by hand")

    def node(j, ks):
        if not ks:
            return np.tanh(params["W_x"] @ x[j] + params["b"]), A0
        (h0, A_0), (h1, A_1) = ks
        return (
            np.tanh(params["W"] @ np.concatenate([A_1 @ h0, A_0 @ h1]) + params["b"]),
            params["W_M"] @ np.concatenate([A_0, A_1], axis=0),
        )

    ref = ref_run(kids, node)
    assert_close(out["h"], np.array([r[0] for r in ref]), np.float64, "mvrnn h")
    assert_close(out["A"], np.array([r[1] for r in ref]), np.float64, "mvrnn A")


# ------------------------------------------------------ 6. TreeRNN


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_treernn(dtype, rng):
    cell = load("treernn.cell", X=7, H=6)
    parts = [np.array(nested_to_parents(random_binary(rng, int(k)))[0]) for k in (1, 2, 5, 16, 9)]
    parents = join_forests(parts, rng)
    forest = Forest.from_parents(parents)
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((len(parents), 7)).astype(dtype)
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    P = {k: v.astype(np.float64) for k, v in params.items()}

    def node(i, kids):
        if not kids:
            return np.tanh(P["W_leaf"] @ x[i] + P["b"])
        return np.tanh(P["W"] @ np.concatenate(kids) + P["b"])

    assert_close(out["h"], np.array(ref_run(children_of(parents), node)), dtype, "treernn h")


# ------------------------------------------------------ 7. semantics corners

CORNERS_CELL = """
cell Corners on tree(arity = 3) {
    dim H = 3, K = 4
    input x[H]
    param P[H, K], Q[K, H]
    state s[H], cnt[H], mn[H], mx[H], k0[H], k1[H], k2[H], dims[H], sx[H]
    state M[H, H], S[2*H, H], v[H], w[H], cm[2*H, H], cv[H]
    node {
        s = x + sum(child.s)
        cnt = 0 * x + sum(1)
        mn = mean(child.s)
        mx = max(child.s)
        k0 = child[0].s; k1 = child[1].s; k2 = child[2].s
        dims = x * H + K
        sx = x * sum(1)
        M = tanh(P @ Q + sum(child.M) @ (P @ Q))
        S = concat(M, sum(child.M))
        v = tanh(M @ x) + max(child.M @ child.v) + sum(M @ child.v) + sum(child.M @ x)
        w = -sum(concat(child.v, x)[0:H] * x + 1) / 2
        cm = sum(concat(child.M, M))
        cv = mean(-child.v / (2 + child.s * child.s)) - x
    }
}
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_semantics_corners(dtype, rng):
    cell = cell_of(CORNERS_CELL)
    assert cell.leaf is None  # leaves run `node` with no children
    parents = relabel(random_recursive_parents(rng, 30, max_children=3), rng.permutation(30))
    fixed = np.array(nested_to_parents(((1,), (2, 3), (4, (5,), (6, 7, 8))))[0])
    parents = join_forests([parents, np.array([-1]), np.array([1, 2, -1]), fixed])
    kids = children_of(parents)
    assert {len(k) for k in kids} == {0, 1, 2, 3}
    forest = Forest.from_parents(parents)
    params = as_dtype(rand_params(cell, rng), dtype)
    x = rng.standard_normal((len(parents), 3)).astype(dtype) - 1.0  # mostly negative: max must not clip at 0
    out = reference.run(cell, forest, params, {"x": x}, dtype=dtype)
    P, Q = params["P"].astype(np.float64), params["Q"].astype(np.float64)
    PQ = P @ Q

    def node(i, ks):
        xi = x[i].astype(np.float64)
        n = len(ks)
        zero = np.zeros(3)
        r = {"s": xi + sum((k["s"] for k in ks), zero), "cnt": np.full(3, float(n))}
        r["mn"] = sum((k["s"] for k in ks), zero) / n if n else zero
        r["mx"] = np.max([k["s"] for k in ks], axis=0) if n else zero
        for j in range(3):
            r[f"k{j}"] = ks[j]["s"] if j < n else zero
        r["dims"] = xi * 3 + 4
        r["sx"] = n * xi
        sum_M = sum((k["M"] for k in ks), np.zeros((3, 3)))
        r["M"] = np.tanh(PQ + sum_M @ PQ)
        r["S"] = np.vstack([r["M"], sum_M])
        r["v"] = (
            np.tanh(r["M"] @ xi)
            + (np.max([k["M"] @ k["v"] for k in ks], axis=0) if n else zero)
            + sum((r["M"] @ k["v"] for k in ks), zero)
            + sum((k["M"] @ xi for k in ks), zero)
        )
        r["w"] = -sum((k["v"] * xi + 1 for k in ks), zero) / 2
        r["cm"] = sum((np.vstack([k["M"], r["M"]]) for k in ks), np.zeros((6, 3)))
        r["cv"] = (sum((-k["v"] / (2 + k["s"] * k["s"]) for k in ks), zero) / n if n else zero) - xi
        return r

    ref = ref_run(kids, node)
    for name in ["s", "cnt", "mn", "mx", "k0", "k1", "k2", "dims", "sx", "M", "S", "v", "w", "cm", "cv"]:
        assert_close(out[name], np.array([r[name] for r in ref]), dtype, f"corners {name}")
    leaves = [i for i, k in enumerate(kids) if not k]
    for name in ["cnt", "mn", "mx", "k0", "k1", "k2", "sx", "w"]:
        assert np.all(out[name][leaves] == 0), name  # exactly 0 at leaves


FUNCTIONS_CELL = """
cell Functions on tree {
    dim H = 6
    input x[H], y[H], z[H]
    state r[H], e[H], l[H], a[H], sp[H], sm[H], ls[H], sg[H], th[H]
    state d[H], sd[H], ds[H], ng[H], nn[H], rs[H]
    state zsp[H], zsm[H], zls[H], zsg[H], zth[H], zr[H], za[H]
    node {
        r = relu(x); e = exp(x); l = log(abs(y)); a = abs(x); sp = softplus(x)
        sm = softmax(x); ls = log_softmax(x); sg = sigmoid(x); th = tanh(x)
        d = x / y; sd = 2 / y; ds = x / 4 - 0.1; ng = -x; nn = -(-x) * -2; rs = 1e-3 - x
        zsp = softplus(z); zsm = softmax(z); zls = log_softmax(z); zsg = sigmoid(z); zth = tanh(z)
        zr = relu(z); za = abs(z)
    }
}
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_functions_vs_torch(dtype, rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    cell = cell_of(FUNCTIONS_CELL)
    n = 40
    forest = Forest.from_parents(np.full(n, -1))
    x = 3 * rng.standard_normal((n, 6))
    x[0] = [40, -40, 0, 25, -25, 1e-3]  # saturation and stability
    x[1] = [30, 30, 30, 30, 30, 30]
    y = np.sign(rng.standard_normal((n, 6))) * (0.5 + np.abs(rng.standard_normal((n, 6))))
    z = 300 * rng.standard_normal((n, 6))  # exp() of these overflows: only stable forms pass
    z[0] = [800, -800, 790, 0, -1, 1]
    x, y, z = x.astype(dtype), y.astype(dtype), z.astype(dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # stable forms only
        out = reference.run(cell, forest, {}, {"x": x, "y": y, "z": z}, dtype=dtype)
    for name, got in out.items():
        assert np.all(np.isfinite(got)), name
    tx, ty = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y.astype(np.float64))
    tz = torch.from_numpy(z.astype(np.float64))
    X, Y = x.astype(np.float64), y.astype(np.float64)
    refs = {
        "r": F.relu(tx),
        "e": torch.exp(tx),
        "l": torch.log(torch.abs(ty)),
        "a": torch.abs(tx),
        "sp": F.softplus(tx, threshold=100.0),
        "sm": F.softmax(tx, dim=-1),
        "ls": F.log_softmax(tx, dim=-1),
        "sg": torch.sigmoid(tx),
        "th": torch.tanh(tx),
        "d": X / Y,
        "sd": 2 / Y,
        "ds": X / 4 - 0.1,
        "ng": -X,
        "nn": -2 * X,
        "rs": 1e-3 - X,
        "zsp": F.softplus(tz, threshold=30.0),
        "zsm": F.softmax(tz, dim=-1),
        "zls": F.log_softmax(tz, dim=-1),
        "zsg": torch.sigmoid(tz),
        "zth": torch.tanh(tz),
        "zr": F.relu(tz),
        "za": torch.abs(tz),
    }
    for name, ref in refs.items():
        ref = ref.numpy() if hasattr(ref, "numpy") else ref
        if name == "e":  # exp(40) is large: compare relative elementwise
            np.testing.assert_allclose(out[name], ref, rtol=RTOL[dtype] * 10, err_msg=name)
            print(
                f"relerr[fn e elementwise, {np.dtype(dtype).name}] = {float(np.max(np.abs(out[name] - ref) / ref)):.3g}"
            )
        else:
            assert_close(out[name], ref, dtype, f"fn {name}")


# ------------------------------------------------------ 8. input validation


def refuse_to_compute(monkeypatch) -> None:
    def forbidden(body, node):
        raise AssertionError("computed a node before validating")

    monkeypatch.setattr(interp, "eval_body", forbidden)


@pytest.fixture
def treelstm_case(rng):
    cell = load("treelstm.cell", X=4, H=3)
    forest = Forest.from_parents(tree_shape("forest", rng))
    return cell, forest, init_params(cell, 0), random_inputs(cell, forest, rng)


def test_missing_and_unknown_input(treelstm_case, monkeypatch):
    cell, forest, params, inputs = treelstm_case
    refuse_to_compute(monkeypatch)
    with pytest.raises(InputError, match=r"missing input 'x'"):
        reference.run(cell, forest, params, {})
    with pytest.raises(InputError, match=r"no input 'y'.*its inputs: x"):
        reference.run(cell, forest, params, {**inputs, "y": inputs["x"]})


def test_wrong_rows_and_dtypes(treelstm_case, monkeypatch):
    cell, forest, params, inputs = treelstm_case
    n = forest.num_nodes
    refuse_to_compute(monkeypatch)
    with pytest.raises(InputError, match=rf"input x must have shape \({n}, 4\).*got \({n - 1}, 4\)"):
        reference.run(cell, forest, params, {"x": inputs["x"][:-1]})
    with pytest.raises(InputError, match=r"input x must have shape"):
        reference.run(cell, forest, params, {"x": inputs["x"][:, :3]})
    with pytest.raises(InputError, match=r"input x must be float32, got dtype int"):
        reference.run(cell, forest, params, {"x": np.ones((n, 4), np.int64)})
    with pytest.raises(InputError, match=r"must be float32, got dtype bool"):
        reference.run(cell, forest, params, {"x": np.ones((n, 4), bool)})
    assert issubclass(InputError, ForestError)


def test_index_input_errors(monkeypatch):
    cell = load("binary_treelstm.cell", V=30, X=4, H=3)
    forest = Forest.from_parents(np.array(nested_to_parents(((1, 2), (3, (4, 5))))[0]))
    params = init_params(cell, 0)
    word = np.arange(forest.num_nodes, dtype=np.int32)
    refuse_to_compute(monkeypatch)
    with pytest.raises(InputError, match=r"index input and must be integers, got dtype float"):
        reference.run(cell, forest, params, {"word": word.astype(np.float32)})
    bad = word.copy()
    bad[5] = 30
    with pytest.raises(InputError, match=r"input word: node 5 has index 30, outside \[0, 30\)"):
        reference.run(cell, forest, params, {"word": bad})
    bad[5], bad[2] = 3, -1
    with pytest.raises(InputError, match=r"node 2 has index -1"):
        reference.run(cell, forest, params, {"word": bad})
    with pytest.raises(InputError, match=r"input word must have shape \(9,\)"):
        reference.run(cell, forest, params, {"word": word[:, None]})


def test_structure_errors(monkeypatch):
    nx = pytest.importorskip("networkx")
    refuse_to_compute(monkeypatch)
    G = nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)])  # node 0 read by 1 and 2
    dag = Forest.from_networkx(G)
    cell = load("treelstm.cell", X=4, H=3)
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(ForestError, match=r"node 0 has 2 parents.*ChildSumTreeLSTM.*dag cell"):
        reference.run(cell, dag, init_params(cell, 0), {"x": x})
    dag2 = cell_of(DAG2_CELL)
    G3 = nx.DiGraph([("a", "r"), ("b", "r"), ("c", "r")])  # numbered a, r, b, c: r is node 1
    with pytest.raises(ForestError, match=r"node 1 has 3 children but cell Dag2's arity is 2"):
        reference.run(dag2, Forest.from_networkx(G3), {}, {"x": np.zeros((4, 2), np.float32)})
    rnn = load("treernn.cell", X=4, H=3)
    three = Forest.from_parents([3, 3, 3, -1])
    with pytest.raises(ForestError, match=r"node 3 has 3 children but cell TreeRNN's arity is 2"):
        reference.run(rnn, three, init_params(rnn, 0), {"x": x})
    with pytest.raises(ForestError, match=r"expected a cortexc.Forest"):
        reference.run(rnn, [3, 3, -1], init_params(rnn, 0), {"x": x})


def test_param_errors(treelstm_case, monkeypatch):
    cell, forest, params, inputs = treelstm_case
    refuse_to_compute(monkeypatch)
    bad = {**params, "U_f": np.zeros((3, 4), np.float32)}
    with pytest.raises(InputError, match=r"param U_f must have shape \(3, 3\), got \(3, 4\)"):
        check_params(cell, bad)
    with pytest.raises(InputError, match=r"param U_f must have shape"):
        reference.run(cell, forest, bad, inputs)
    with pytest.raises(InputError, match=r"missing params.*W_f"):
        check_params(cell, {k: v for k, v in params.items() if k != "W_f"})
    with pytest.raises(InputError, match=r"no param W_zzz"):
        check_params(cell, {**params, "W_zzz": params["W_f"]})
    with pytest.raises(InputError, match=r"must be a float array"):
        check_params(cell, {**params, "b_f": np.zeros(3, np.int32)})
    assert set(check_params(cell, {"b_f": np.zeros(3)}, partial=True)) == {"b_f"}


# ------------------------------------------------------ 9. init

INIT_CELL = """
cell Inits on tree {
    dim H = 2
    input x[H]
    param Nm[300, 400] init normal(-1.5, 0.25), Un[300, 400] init uniform(-2, 3)
    param Xa[300, 200] init xavier, Df[200, 100], dv[50], xv[20000] init xavier
    param Z[30, 40] init zeros, O[30, 40] init ones, vo[7] init ones
    state h[H]
    node { h = x }
}
"""


def test_init_deterministic_per_seed(rng):
    cell = load("treelstm.cell", X=16, H=12)
    seed = int(rng.integers(1 << 31))
    a, b, c = init_params(cell, seed), init_params(cell, seed), init_params(cell, seed + 1)
    assert list(a) == [d.name for d in cell.params]
    for d in cell.params:
        assert a[d.name].shape == d.shape and a[d.name].dtype == np.float32
        assert a[d.name].flags.c_contiguous
        assert np.array_equal(a[d.name], b[d.name])
    assert not np.array_equal(a["W_iou"], c["W_iou"])
    assert np.all(a["b_iou"] == 0) and np.all(a["b_f"] == 0)  # declared zeros


def test_init_statistics(rng):
    cell = cell_of(INIT_CELL)
    p = init_params(cell, int(rng.integers(1 << 31)))
    assert np.all(p["Z"] == 0) and np.all(p["O"] == 1) and np.all(p["vo"] == 1)
    assert np.all(p["dv"] == 0)  # default for a vector: zeros
    nm = p["Nm"].astype(np.float64)
    assert abs(nm.mean() + 1.5) < 0.01 and abs(nm.std() - 0.25) < 0.01 * 0.25 * 3
    un = p["Un"].astype(np.float64)
    assert un.min() >= -2 and un.max() <= 3 and un.min() < -1.99 and un.max() > 2.99
    assert abs(un.mean() - 0.5) < 0.02 and abs(un.std() - 5 / np.sqrt(12)) < 0.02
    for name, fan_out, fan_in in [("Xa", 300, 200), ("Df", 200, 100), ("xv", 20000, 1)]:
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        w = p[name].astype(np.float64)
        assert np.abs(w).max() <= bound * (1 + 1e-6), name
        assert np.abs(w).max() > 0.999 * bound, name
        assert abs(w.std() - bound / np.sqrt(3)) < 0.05 * bound / np.sqrt(3), name
        assert abs(w.mean()) < 0.05 * bound, name


def test_init_matches_torch_xavier_bound():
    torch = pytest.importorskip("torch")
    # torch's xavier_uniform_ on an [out, in] weight has bound sqrt(6 / (in + out)): fill the
    # whole range and compare extremes with ours on the same shape.
    w = torch.empty(300, 200)
    torch.nn.init.xavier_uniform_(w, generator=torch.Generator().manual_seed(0))
    cell = cell_of(INIT_CELL)
    ours = init_params(cell, 1)["Xa"]
    assert abs(float(w.abs().max()) - float(np.abs(ours).max())) < 1e-3
