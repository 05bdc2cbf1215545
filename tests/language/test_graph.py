"""Graph cells (language Version 3): `cell NAME on graph(steps = T)`, run for T synchronous steps on any
directed graph (cycles, self-loops, repeated edges, isolated nodes), with `init` for step 0, `prev.s` and
`child.s` (the in-neighbours one step earlier) in `node`, `edge.rel` / `edge.w` edge inputs and per-node
outputs. Forward and backward on the interpreter, the compiled C and the emulated CUDA against per-node
float64 PyTorch written here from our own edge lists (and against `torch_geometric.nn.GatedGraphConv`
itself); `Forest.from_edges`, `from_networkx` and `concat` of graphs; the typed runtime errors and the
located ones; 1 and 2 threads bitwise; nvcc."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import CellSyntaxError, CellTypeError, ForestError, InputError
from cortexc.frontend import lower_source
from tests.helpers import (
    EXAMPLES,
    assert_packages_compile_with_nvcc_without_spills,
    digests_at_thread_counts,
    relative_error,
)

torch = pytest.importorskip("torch")

DEVICES = ["interp", "cpu", "cuda-emu"]

#: sum, mean and max over the in-neighbours, the in-degree, the node's own previous states, two states and
#: an output read after the last step
SIMPLE = """
cell Simple on graph(steps = T) {
    dim X = 3, H = 4, T = 2
    input x[X]
    param W[H, X], U[H, H], V[H, H], P[H, H], b[H], d[H], W_o[2, H]
    state h[H], c[H]
    init {
        h = tanh(W @ x)
        c = 0.5 * (W @ x)
    }
    node {
        c = 0.5 * prev.c + V @ mean(child.h) + sum(1) * d
        h = tanh(U @ sum(child.h) + P @ max(child.c) + c + b) + 0.5 * prev.h
    }
    output y[2] = W_o @ h
}
"""

#: a float weight per edge scaling the message, and the node input read again at every step
WEIGHTED = """
cell Weighted on graph(steps = T) {
    dim X = 3, H = 4, T = 2
    input x[X]
    input w[1] on edge
    param W[H, X], U[H, H], V[H, H], b[H]
    state h[H]
    init { h = tanh(W @ x) }
    node { h = tanh(U @ sum(edge.w * child.h) + V @ max(edge.w * child.h) + W @ x + b) + 0.5 * prev.h }
}
"""

#: torch_geometric.nn.GatedGraphConv(out_channels=H, num_layers=T, aggr="add") with its step weights tied:
#: x zero-padded to H, then per step m_i = sum over edges j -> i of x_j @ weight (= M @ h_j with M = weight^T)
#: and torch.nn.GRUCell(m, h) with its gates (r, z, n) stacked in that order and both biases
PYG_GATED = """
cell PygGated on graph(steps = T) {
    dim X = 3, H = 5, T = 3
    input x[X]
    param M[H, H], W_ih[3*H, H], b_ih[3*H], W_hh[3*H, H], b_hh[3*H]
    state h[H]
    init { h = concat(x, 0 * x[0:H-X]) }
    node {
        gi = W_ih @ sum(M @ child.h) + b_ih
        gh = W_hh @ prev.h + b_hh
        r = sigmoid(gi[0:H] + gh[0:H])
        z = sigmoid(gi[H:2*H] + gh[H:2*H])
        n = tanh(gi[2*H:3*H] + r * gh[2*H:3*H])
        h = (1 - z) * n + z * prev.h
    }
}
"""

#: acyclic cells, to be refused a graph with a cycle
ACYCLIC = """
cell OnTree on tree {
    dim H = 3
    input x[H]
    state h[H]
    node { h = tanh(x + sum(child.h)) }
}
cell OnDag on dag {
    dim H = 3
    input x[H]
    state h[H]
    node { h = tanh(x + sum(child.h)) }
}
"""

#: the small dims every runtime test gives examples/ggnn.cell
GGNN_DIMS = dict(X=4, H=5, R=3, C=2)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """`build(kind, T)`: the package of a cell (`simple`, `weighted`, `ggnn`, `pyg`, `acyclic`) compiled with
    `-D T=...`, once per module (the kernels do not depend on T: one build per cell)."""
    root = tmp_path_factory.mktemp("graph")
    texts = {"simple": SIMPLE, "weighted": WEIGHTED, "pyg": PYG_GATED, "acyclic": ACYCLIC}
    built: dict = {}

    def get(kind: str, steps: int | None = None):
        key = (kind, steps)
        if key not in built:
            dims = {} if steps is None else {"T": steps}
            out = root / f"{kind}_{steps}"
            if kind == "ggnn":
                built[key] = cortexc.load(EXAMPLES / "ggnn.cell", out_dir=out, **GGNN_DIMS, **dims)
            else:
                path = root / f"{kind}.cell"
                path.write_text(texts[kind], encoding="utf-8")
                built[key] = cortexc.load(path, out_dir=out, **dims)
        return built[key]

    return get


# --------------------------------------------------------------------------- graphs, written here


def _random_graph(rng: np.random.Generator, n: int) -> tuple[Forest, np.ndarray, np.ndarray]:
    """A random graph with every case: a 3-cycle, a self-loop, a repeated edge, two isolated nodes (one of
    them the last id, so only `num_nodes` says it exists), two nodes no edge reads (in-degree 0) and random
    edges; ids shuffled and edges in a random order. Returns the forest and our own src, dst lists."""
    ids = rng.permutation(n - 1)
    isolated = {n - 1, int(ids[0])}
    sources, rest = ids[1:3], ids[3:]
    edges = [(rest[0], rest[1]), (rest[1], rest[2]), (rest[2], rest[0]), (rest[3], rest[3])]
    edges += [(rest[4], rest[5])] * 2
    edges += [(s, rng.choice(rest)) for s in sources]
    readers = np.r_[sources, rest]
    edges += [(rng.choice(readers), rng.choice(rest)) for _ in range(int(1.5 * n))]
    edges = [edges[i] for i in rng.permutation(len(edges))]
    src = np.array([int(e[0]) for e in edges], np.int64)
    dst = np.array([int(e[1]) for e in edges], np.int64)
    assert not isolated & (set(src.tolist()) | set(dst.tolist()))
    return Forest.from_edges(src, dst, num_nodes=n), src, dst


def _graph(shape: str, rng: np.random.Generator) -> tuple[Forest, np.ndarray, np.ndarray]:
    if shape == "random":
        return _random_graph(rng, int(rng.integers(12, 30)))
    if shape == "tree":  # a graph cell takes any forest: the edges of a tree read from the forest itself
        forest = Forest.random(3, rng=rng, max_children=3, max_nodes=9)
        return forest, np.asarray(forest.edge_child), np.asarray(forest.edge_parent)
    assert shape == "edgeless"
    empty = np.zeros(0, np.int64)
    return Forest.from_edges(empty, empty, num_nodes=5), empty, empty


def _forest_edge_order(forest: Forest, src, dst) -> np.ndarray:
    """For each edge of the forest, its number in our src/dst lists. A node's children must be its
    in-neighbours in the order their edges appear (asserted here), so the k-th edge into v is our k-th."""
    order = np.empty(forest.num_edges, np.int64)
    assert forest.num_edges == len(src)
    for v in range(forest.num_nodes):
        ours = np.flatnonzero(np.asarray(dst) == v)
        start, stop = int(forest.edge_ptr[v]), int(forest.edge_ptr[v + 1])
        assert list(forest.edge_child[start:stop]) == [int(src[i]) for i in ours], f"children of {v}"
        assert list(forest.edge_parent[start:stop]) == [v] * len(ours)
        order[start:stop] = ours
    return order


def _in_edges(n: int, dst) -> list[list[int]]:
    """Our edge numbers into each node, in our order."""
    edges: list[list[int]] = [[] for _ in range(n)]
    for i, v in enumerate(dst):
        edges[int(v)].append(i)
    return edges


# --------------------------------------------------------------------------- float64 references


def _simple_reference(n: int, src, dst, p: dict, inputs: dict, steps: int) -> dict:
    x = inputs["x"]
    H = p["b"].shape[0]
    h = [torch.tanh(p["W"] @ x[v]) for v in range(n)]
    c = [0.5 * (p["W"] @ x[v]) for v in range(n)]
    into = _in_edges(n, dst)
    zero = torch.zeros(H, dtype=torch.float64)
    for _ in range(steps):
        new_h, new_c = [], []
        for v in range(n):
            kids = [int(src[i]) for i in into[v]]
            total = sum((h[u] for u in kids), zero)
            mean = total / len(kids) if kids else zero
            biggest = torch.stack([c[u] for u in kids]).max(dim=0).values if kids else zero
            cv = 0.5 * c[v] + p["V"] @ mean + len(kids) * p["d"]
            new_h.append(torch.tanh(p["U"] @ total + p["P"] @ biggest + cv + p["b"]) + 0.5 * h[v])
            new_c.append(cv)
        h, c = new_h, new_c
    hs = torch.stack(h)
    return {"h": hs, "c": torch.stack(c), "y": hs @ p["W_o"].T}


def _ggnn_reference(n: int, src, dst, p: dict, inputs: dict, steps: int) -> dict:
    """examples/ggnn.cell, node by node and step by step."""
    x, rel = inputs["x"], inputs["rel"]
    h = [torch.tanh(p["W_in"] @ x[v]) for v in range(n)]
    into = _in_edges(n, dst)
    for _ in range(steps):
        new_h = []
        for v in range(n):
            m = p["b_m"] + sum((p["A"][int(rel[i])] @ h[int(src[i])] for i in into[v]), torch.zeros_like(p["b_m"]))
            z = torch.sigmoid(p["W_z"] @ m + p["U_z"] @ h[v])
            r = torch.sigmoid(p["W_r"] @ m + p["U_r"] @ h[v])
            cand = torch.tanh(p["W_n"] @ m + p["U_n"] @ (r * h[v]))
            new_h.append((1 - z) * h[v] + z * cand)
        h = new_h
    hs = torch.stack(h)
    return {"h": hs, "logits": hs @ p["W_out"].T + p["b_out"]}


def _weighted_reference(n: int, src, dst, p: dict, inputs: dict, steps: int) -> dict:
    x, w = inputs["x"], inputs["w"]
    H = p["b"].shape[0]
    h = [torch.tanh(p["W"] @ x[v]) for v in range(n)]
    into = _in_edges(n, dst)
    zero = torch.zeros(H, dtype=torch.float64)
    for _ in range(steps):
        new_h = []
        for v in range(n):
            messages = [w[i] * h[int(src[i])] for i in into[v]]
            total = sum(messages, zero)
            biggest = torch.stack(messages).max(dim=0).values if messages else zero
            pre = p["U"] @ total + p["V"] @ biggest + p["W"] @ x[v] + p["b"]
            new_h.append(torch.tanh(pre) + 0.5 * h[v])
        h = new_h
    return {"h": torch.stack(h)}


REFERENCES = {
    "simple": ("Simple", _simple_reference),
    "ggnn": ("GGNN", _ggnn_reference),
    "weighted": ("Weighted", _weighted_reference),
}


def _model(module, name: str, device: str, rng: np.random.Generator, jitter: float = 0.3):
    """The seeded params plus noise, so that no gradient is trivially zero."""
    model = getattr(module, name)(device=device, seed=int(rng.integers(2**31)))
    model.load_params(
        {k: v + (jitter * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()}
    )
    return model


def _our_inputs(model, n: int, num_edges: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs, edge inputs in OUR edge order."""
    inputs = {}
    for decl in model.signature.inputs:
        rows = num_edges if decl.on_edge else n
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, rows).astype(np.int32)
        else:
            inputs[decl.name] = rng.standard_normal((rows, *decl.shape)).astype(np.float32)
    return inputs


def _check(model, forest: Forest, src, dst, reference, steps: int, rng: np.random.Generator, what: str) -> None:
    """Forward (states and outputs) and backward (every param, float node and edge input) against the
    reference, which reads our edge lists; the model gets the edge inputs in the forest's edge order."""
    n = forest.num_nodes
    order = _forest_edge_order(forest, src, dst)
    ours = _our_inputs(model, n, len(src), rng)
    on_edge = {d.name for d in model.signature.inputs if d.on_edge}
    given = {k: (v[order] if k in on_edge else v) for k, v in ours.items()}
    params = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in model.params.items()}
    floats = {
        k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in ours.items() if v.dtype.kind == "f"
    }
    expected = reference(n, src, dst, params, {**ours, **floats}, steps)
    out = model(forest, grad=True, **given)
    assert set(out) == set(expected), what
    for name, value in expected.items():
        assert out[name].shape == tuple(value.shape), f"{what}: {name} shape"
        assert relative_error(out[name], value.detach().numpy()) < 1e-5, f"{what}: {name}"
    upstream = {name: rng.standard_normal(value.shape) for name, value in expected.items()}
    sum((value * torch.tensor(upstream[name])).sum() for name, value in expected.items()).backward()
    grads = model.backward(out, {k: v.astype(np.float32) for k, v in upstream.items()})
    assert set(grads) == set(params) | set(floats), what
    for name, leaf in {**params, **floats}.items():
        want = np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.numpy()
        if name in on_edge:
            want = want[order]  # the model's edge gradients are in the forest's edge order
        assert grads[name].shape == tuple(leaf.shape), f"{what}: d{name} shape"
        assert relative_error(grads[name], want) < 1e-5, f"{what}: d{name}"


#: (steps, graph): random graphs with everything at T = 1, 2 and 5; a tree and a graph without edges
CASES = [(1, "random"), (2, "random"), (5, "random"), (3, "tree"), (2, "edgeless")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(REFERENCES))
@pytest.mark.parametrize(("steps", "shape"), CASES, ids=[f"T{t}-{s}" for t, s in CASES])
def test_graph_cells_match_per_node_torch(build, rng, device, kind, steps, shape):
    name, reference = REFERENCES[kind]
    module = build(kind, steps)
    model = _model(module, name, device, rng)
    assert model.signature.structure.steps == steps  # -D T=... is the number of steps
    forest, src, dst = _graph(shape, rng)
    _check(model, forest, src, dst, reference, steps, rng, f"{kind} {device} T={steps} {shape}")


def test_the_steps_are_the_dim_t(build, rng):
    """The same params and graph at T = 2 and T = 5 give different states (the steps are not fixed at
    compile time by the source's `T = 2`), and the signature carries the override."""
    forest, _, _ = _random_graph(rng, 15)
    x = rng.standard_normal((forest.num_nodes, 3)).astype(np.float32)
    two, five = build("simple", 2).Simple(device="cpu", seed=1), build("simple", 5).Simple(device="cpu", seed=1)
    assert (two.signature.structure.steps, five.signature.structure.steps) == (2, 5)
    assert relative_error(two(forest, x=x)["h"], five(forest, x=x)["h"]) > 1e-3


# --------------------------------------------------------------------------- torch_geometric


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
@pytest.mark.parametrize("steps", [1, 4])
def test_gated_graph_conv_matches_torch_geometric(build, rng, device, steps):
    """The cell above against `torch_geometric.nn.GatedGraphConv` itself (in float64, from the same float32
    weights, every step's weight the same matrix): forward, and the gradients of a scalar loss wrt x, the
    shared message weight (the sum over steps of PyG's weight.grad, transposed) and the GRU's weights."""
    pyg = pytest.importorskip("torch_geometric")
    X, H = 3, 5
    torch.manual_seed(int(rng.integers(2**31)))
    conv = pyg.nn.GatedGraphConv(out_channels=H, num_layers=steps, aggr="add")
    with torch.no_grad():
        conv.weight.copy_(conv.weight[0].expand_as(conv.weight).clone())  # tie the steps' weights
        conv.rnn.bias_ih.copy_(0.3 * torch.randn(3 * H))  # nonzero biases of both kinds
        conv.rnn.bias_hh.copy_(0.3 * torch.randn(3 * H))
    conv = conv.double()
    rnn = conv.rnn
    params = {
        "M": conv.weight[0].T,
        "W_ih": rnn.weight_ih,
        "b_ih": rnn.bias_ih,
        "W_hh": rnn.weight_hh,
        "b_hh": rnn.bias_hh,
    }
    model = build("pyg", steps).PygGated(device=device, seed=0)
    model.load_params({k: v.detach().numpy().astype(np.float32) for k, v in params.items()})

    forest, src, dst = _random_graph(rng, int(rng.integers(12, 30)))
    x = rng.standard_normal((forest.num_nodes, X)).astype(np.float32)
    x64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    edge_index = torch.tensor(np.stack([src, dst]))  # j -> i is aggregated at i: i reads j
    expected = conv(x64, edge_index)
    out = model(forest, grad=True, x=x)
    assert relative_error(out["h"], expected.detach().numpy()) < 1e-5, f"{device} T={steps}: h"

    upstream = rng.standard_normal(expected.shape)
    (expected * torch.tensor(upstream)).sum().backward()
    grads = model.backward(out, {"h": upstream.astype(np.float32)})
    want = {
        "M": conv.weight.grad.sum(dim=0).T,
        "W_ih": rnn.weight_ih.grad,
        "b_ih": rnn.bias_ih.grad,
        "W_hh": rnn.weight_hh.grad,
        "b_hh": rnn.bias_hh.grad,
        "x": x64.grad,
    }
    assert set(grads) == set(want)
    for name, value in want.items():
        assert relative_error(grads[name], value.numpy()) < 1e-5, f"{device} T={steps}: d{name}"


# --------------------------------------------------------------------------- forests of graphs


@pytest.mark.parametrize("device", DEVICES)
def test_concat_of_a_cyclic_graph_and_a_tree_equals_running_each(build, rng, device):
    """Forest.concat of graphs: nodes and edges of the first, then of the second; states, outputs and
    gradients (params summed, inputs end to end) as if each were run alone."""
    module = build("ggnn", 3)
    model = _model(module, "GGNN", device, rng)
    cyclic, _, _ = _random_graph(rng, 14)
    tree = Forest.random(3, rng=rng, max_children=3, max_nodes=8)
    parts = [cyclic, tree]
    inputs = [_our_inputs(model, f.num_nodes, f.num_edges, rng) for f in parts]
    upstream = [
        {"h": rng.standard_normal((f.num_nodes, 5)), "logits": rng.standard_normal((f.num_nodes, 2))} for f in parts
    ]
    upstream = [{k: v.astype(np.float32) for k, v in u.items()} for u in upstream]
    alone_out, alone_grads = [], []
    for forest, given, up in zip(parts, inputs, upstream):
        out = model(forest, grad=True, **given)
        alone_out.append({k: v.copy() for k, v in out.items()})
        alone_grads.append(model.backward(out, up))
    both = Forest.concat(parts)
    assert both.num_nodes == sum(f.num_nodes for f in parts) and both.num_edges == sum(f.num_edges for f in parts)
    given = {k: np.concatenate([i[k] for i in inputs]) for k in inputs[0]}
    out = model(both, grad=True, **given)
    for key in ("h", "logits"):
        assert relative_error(out[key], np.concatenate([o[key] for o in alone_out])) < 1e-5, key
    grads = model.backward(out, {k: np.concatenate([u[k] for u in upstream]) for k in upstream[0]})
    assert relative_error(grads["x"], np.concatenate([g["x"] for g in alone_grads])) < 1e-5
    for name in model.params:
        assert relative_error(grads[name], alone_grads[0][name] + alone_grads[1][name]) < 1e-5, f"d{name}"


def test_from_networkx_takes_cycles(build, rng):
    """The same graph (no repeated edges: a DiGraph has none) from networkx and from edge lists gives the
    same states, children in `G.predecessors` order against edge order changing only the rounding."""
    nx = pytest.importorskip("networkx")
    forest, src, dst = _random_graph(rng, 16)
    pairs = list(dict.fromkeys(zip(src.tolist(), dst.tolist())))  # repeated edges once, in order
    graph = nx.DiGraph()
    graph.add_nodes_from(range(forest.num_nodes))
    graph.add_edges_from(pairs)
    from_nx = Forest.from_networkx(graph)
    from_lists = Forest.from_edges([u for u, _ in pairs], [v for _, v in pairs], num_nodes=forest.num_nodes)
    assert from_nx.num_nodes == from_lists.num_nodes and from_nx.num_edges == from_lists.num_edges == len(pairs)
    for v in range(forest.num_nodes):
        assert list(from_nx.children(v)) == list(graph.predecessors(v))
        assert sorted(from_nx.children(v)) == sorted(from_lists.children(v))
    model = _model(build("simple", 3), "Simple", "cpu", rng)
    x = rng.standard_normal((forest.num_nodes, 3)).astype(np.float32)
    a, b = model(from_nx, x=x), model(from_lists, x=x)
    for key in ("h", "c", "y"):
        assert relative_error(a[key], b[key]) < 1e-5, key
    assert relative_error(a["h"], model(forest, x=x)["h"]) > 1e-3  # the repeated edge really counts twice


# --------------------------------------------------------------------------- typed runtime errors


def _cyclic(rng: np.random.Generator) -> tuple[Forest, set[int]]:
    """A graph whose only cycle goes through 3 of its 7 nodes (ids shuffled), each node read by at most one
    other (a tree but for the cycle), with a tail into the cycle; and the cycle's nodes."""
    ids = [int(i) for i in rng.permutation(7)]
    a, b, c, t1, t2, leaf1, leaf2 = ids
    src = [a, b, c, t1, t2, leaf1, leaf2]  # a -> b -> c -> a; t2 -> t1 -> a; leaf1 -> t2, leaf2 -> t2
    dst = [b, c, a, a, t1, t2, t2]
    return Forest.from_edges(src, dst), {a, b, c}


@pytest.mark.parametrize("device", ["interp", "cpu"])
def test_tree_and_dag_cells_refuse_a_cycle_naming_a_node_on_it(build, rng, device):
    module = build("acyclic")
    forest, cycle = _cyclic(rng)
    x = np.zeros((forest.num_nodes, 3), np.float32)
    for cls, structure in ((module.OnTree, "tree"), (module.OnDag, "dag")):
        with pytest.raises(ForestError, match=rf"cell {cls.__name__} runs on a {structure}") as err:
            cls(device=device)(forest, x=x)
        found = re.search(r"cycle through node (\d+) \(each reads the next: ([\d >-]+)\)", str(err.value))
        assert found, str(err.value)
        assert int(found.group(1)) in cycle, str(err.value)
        chain = [int(i) for i in found.group(2).split(" -> ")]
        assert set(chain) == cycle and chain[0] == chain[-1], str(err.value)
        # a self-loop is a cycle too
        loop = Forest.from_edges([0, 1, 1], [1, 1, 2])
        with pytest.raises(ForestError, match=r"node 1 reads itself"):
            cls(device=device)(loop, x=np.zeros((3, 3), np.float32))
    # and a graph cell takes both
    graph_model = build("simple", 2).Simple(device=device, seed=0)
    assert graph_model(forest, x=np.zeros((7, 3), np.float32))["h"].shape == (7, 4)


@pytest.mark.parametrize("device", ["interp", "cpu", "cuda-emu"])
def test_bad_edge_inputs_of_a_graph_cell_are_typed_errors(build, device):
    """Wrong row counts and indices out of range, naming the input and the edge (its number, its two nodes)."""
    model = build("ggnn", 2).GGNN(device=device, seed=0)
    forest = Forest.from_edges([2, 0, 1, 1], [0, 1, 1, 2])  # edges by reader: 2->0, 0->1, 1->1, 1->2
    x = np.zeros((3, 4), np.float32)
    good = np.zeros(4, np.int32)
    with pytest.raises(InputError, match=r"input rel must have shape \(4,\) \(one index per edge\), got \(3,\)"):
        model(forest, x=x, rel=good[:3])
    with pytest.raises(InputError, match=r"input rel: edge 2 \(node 1 -> node 1\) has index 3, outside \[0, 3\)"):
        model(forest, x=x, rel=np.array([0, 1, 3, 2], np.int32))
    with pytest.raises(InputError, match=r"input rel: edge 3 \(node 1 -> node 2\) has index -1, outside \[0, 3\)"):
        model(forest, x=x, rel=np.array([0, 1, 2, -1], np.int32))
    weighted = build("weighted", 2).Weighted(device=device, seed=0)
    with pytest.raises(InputError, match=r"input w must have shape \(4, 1\) \(one row per edge\), got \(3, 1\)"):
        weighted(forest, x=np.zeros((3, 3), np.float32), w=np.zeros((3, 1), np.float32))
    with pytest.raises(InputError, match=r"input w must have shape \(4, 1\) \(one row per edge\), got \(4,\)"):
        weighted(forest, x=np.zeros((3, 3), np.float32), w=np.zeros(4, np.float32))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([0, 1], [1]), "src and dst must have one id per edge alike, got 2 and 1"),
        (([0, 1], [1, -2]), r"dst\[1\] is -2: node ids are 0 or more"),
        (([-1, 1], [1, 0]), r"src\[0\] is -1: node ids are 0 or more"),
        (([0, 1, 2], [1, 0, 3], 3), r"edge 2 \(2 -> 3\) names a node outside 0..2 \(num_nodes=3\)"),
        (([0, 5], [1, 0], 3), r"edge 1 \(5 -> 0\) names a node outside 0..2"),
        (([0.5], [1]), "src must hold integer node ids"),
    ],
)
def test_from_edges_rejects_bad_edges(args, message):
    with pytest.raises(ForestError, match=message):
        Forest.from_edges(*args)


def test_from_edges_numbers_children_in_edge_order():
    """Children by reader, in the order the edges appear; num_nodes keeps trailing isolated nodes."""
    forest = Forest.from_edges([3, 0, 2, 0, 2, 1], [1, 1, 0, 1, 2, 3], num_nodes=6)
    assert forest.num_nodes == 6 and forest.num_edges == 6
    assert [list(forest.children(v)) for v in range(6)] == [[2], [3, 0, 0], [2], [1], [], []]
    assert list(forest.edge_parent) == [0, 1, 1, 1, 2, 3]
    assert list(forest.edge_child) == [2, 3, 0, 0, 2, 1]
    assert list(forest.edge_ptr) == [0, 1, 4, 5, 6, 6, 6]


# --------------------------------------------------------------------------- located errors


def _cell(header: str, blocks: str, extra: str = "") -> str:
    return f"cell E on {header} {{\n    dim H = 3, T = 2\n    input x[H]\n    state h[H]\n    {blocks}{extra}\n}}\n"


GRAPH = "graph(steps = T)"
ERRORS = [
    (
        CellTypeError,
        _cell("tree", "node { h = tanh(x + prev.h) }"),
        "prev.h outside a graph cell",
        (5, "prev.h"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "init { h = tanh(prev.h) }\n    node { h = tanh(x + prev.h) }"),
        "prev.h in the init block: step 0 has no step before it",
        (5, "prev.h"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "init { h = x }\n    node { h = tanh(x + prev.h) }", "\n    output y[H] = prev.h"),
        "prev.h in an output",
        (7, "prev.h"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "init { h = x }\n    node { h = tanh(dropout(x, 0.5) + prev.h) }"),
        "dropout in a graph cell's node block",
        (6, "dropout"),
    ),
    (
        CellTypeError,
        _cell("tree", "init { h = x }\n    node { h = tanh(x + sum(child.h)) }"),
        "an init block in a tree cell",
        (5, "init {"),
    ),
    (
        CellTypeError,
        _cell("dag", "init { h = x }\n    node { h = tanh(x + sum(child.h)) }"),
        "an init block in a dag cell",
        (5, "init {"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "node { h = tanh(x + prev.h) }"),
        "graph cell 'E' has no init block",
        (1, "E on"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "leaf { h = x }\n    init { h = x }\n    node { h = tanh(x + prev.h) }"),
        "a leaf block in a graph cell",
        (5, "leaf {"),
    ),
    (
        CellTypeError,
        _cell("graph(steps = 0)", "init { h = x }\n    node { h = tanh(x + prev.h) }"),
        "a graph cell runs at least 1 step, not 0",
        (1, "0)"),
    ),
    (
        CellTypeError,
        _cell("graph(steps = T - 3)", "init { h = x }\n    node { h = tanh(x + prev.h) }"),
        "a graph cell runs at least 1 step, not -1",
        (1, "T - 3"),
    ),
    (
        CellTypeError,
        _cell("graph(steps = x)", "init { h = x }\n    node { h = tanh(x + prev.h) }"),
        "the number of steps must be a constant",
        (1, "x)"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "init { h = x }\n    node { h = tanh(x + prev.h) }", "\n    output y[H] at root = h"),
        "output y is 'at root' in a graph cell",
        (7, "y[H]"),
    ),
    (
        CellTypeError,
        _cell(GRAPH, "init { h = x + sum(child.h) }\n    node { h = tanh(x + prev.h) }"),
        "child.h in the init block",
        (5, "child.h"),
    ),
    (
        CellSyntaxError,
        _cell("graph(stepz = 2)", "init { h = x }\n    node { h = tanh(x + prev.h) }"),
        "a graph cell is written 'on graph(steps = T)', not 'stepz = ...'",
        (1, "stepz"),
    ),
]


@pytest.mark.parametrize(("kind", "source", "message", "at"), ERRORS, ids=[e[2][:36] for e in ERRORS])
def test_graph_errors_are_located(kind, source, message, at):
    line, text = at
    with pytest.raises(kind) as err:
        lower_source(source, "t.cell")
    shown = str(err.value)
    assert message in shown, shown
    col = source.splitlines()[line - 1].index(text) + 1
    assert shown.startswith(f"t.cell:{line}:{col}: error:"), shown


def test_dropout_in_init_and_outputs_of_a_graph_cell_is_fine():
    source = _cell(
        GRAPH, "init { h = dropout(x, 0.5) }\n    node { h = tanh(x + prev.h) }", "\n    output y[H] = dropout(h, 0.1)"
    )
    (cell,) = lower_source(source, "t.cell")
    assert cell.name == "E"


def test_steps_follow_a_dim_override(tmp_path):
    """`-D T=...` sets the steps; an override that makes them 0 is the located steps error."""
    source = _cell("graph(steps = T - 1)", "init { h = x }\n    node { h = tanh(x + prev.h) }")
    (cell,) = lower_source(source, "g.cell", defines={"T": 8})
    assert cell.steps == 7
    path = tmp_path / "g.cell"
    path.write_text(source, encoding="utf-8")
    assert cortexc.load(path, out_dir=tmp_path / "pkg", T=4).E.signature.structure.steps == 3
    with pytest.raises(CellTypeError, match="a graph cell runs at least 1 step, not 0") as err:
        lower_source(source, "g.cell", defines={"T": 1})
    assert str(err.value).startswith(f"g.cell:1:{source.index('T - 1') + 1}: error:"), str(err.value)


# --------------------------------------------------------------------------- threads and nvcc


WORKER = r"""
import json, sys
import numpy as np
import cortexc
from cortexc import Forest
module = cortexc.load(sys.argv[1], out_dir=sys.argv[2], T=3)
model = module.GGNN(device="cpu", seed=3)
rng = np.random.default_rng(5)
n, e = 300, 1200
src = np.r_[rng.integers(0, n - 20, e), np.arange(10), np.arange(5)]   # self-loops, repeated edges
dst = np.r_[rng.integers(0, n - 20, e), np.arange(10), np.arange(5)]
forest = Forest.from_edges(src, dst, num_nodes=n)
inputs = {"x": rng.standard_normal((n, 16)).astype(np.float32),
          "rel": rng.integers(0, 3, forest.num_edges).astype(np.int32)}
out = model(forest, grad=True, **inputs)
grads = model.backward(out, {"h": rng.standard_normal(out["h"].shape).astype(np.float32),
                             "logits": rng.standard_normal(out["logits"].shape).astype(np.float32)})
from tests.helpers import digest  # the worker runs in the checkout
print(json.dumps(digest({**out, **{f"d_{name}": value for name, value in grads.items()}})))
"""


@pytest.mark.slow
def test_one_and_two_threads_give_the_same_bits(tmp_path):
    digests = digests_at_thread_counts(WORKER, (EXAMPLES / "ggnn.cell").read_text(encoding="utf-8"), tmp_path)
    assert digests[0] == digests[1]


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_graph_cells_compile_with_nvcc_without_spills(tmp_path):
    module = cortexc.load(EXAMPLES / "ggnn.cell", out_dir=tmp_path / "ggnn")
    assert_packages_compile_with_nvcc_without_spills([module])


# --------------------------------------------------------------------------- double-buffered inference


@pytest.mark.parametrize("device", DEVICES)
def test_an_inference_double_buffers_the_steps_and_gives_the_same_bits(build, rng, device):
    """Without a backward to follow, the steps' states take two blocks of N rows in turn (`state_rows` 2 N
    at T = 5, against 6 N kept for a backward); the results are bitwise those of the every-step layout, and
    the model's inference (which uses it) agrees with the interpreter's."""
    from cortexc.runtime.edges import to_kernel_order
    from cortexc.runtime.graph import last_step, linearize_steps
    from cortexc.runtime.validate import check_inputs

    module = build("weighted", 5)  # reads x at every step (a hoisted product) and an edge input
    model = _model(module, "Weighted", device, rng)
    forest, src, dst = _random_graph(rng, 25)
    inputs = {
        k: v[_forest_edge_order(forest, src, dst)] if k == "w" else v
        for k, v in _our_inputs(model, 25, len(src), rng).items()
    }
    sig = model.signature
    checked = to_kernel_order(sig, forest, check_inputs(sig, forest, inputs))
    executor = model._executor_for_device()
    every, two = linearize_steps(forest, 5, True), linearize_steps(forest, 5, False)
    assert (every.state_rows, two.state_rows) == (6 * 25, 2 * 25)
    results = []
    for lin in (every, two):
        out, _ = executor.forward(lin, checked)
        assert out["h"].shape[0] == lin.state_rows
        results.append(last_step(sig, dict(out), lin))
    for name in results[0]:
        assert np.array_equal(results[0][name], results[1][name]), name
    inferred = model(forest, **inputs)
    expected = module.Weighted(device="interp", seed=0)
    expected.load_params(model.params)
    for name, value in expected(forest, **inputs).items():
        assert relative_error(inferred[name], value) < 1e-5, name
