"""Edge inputs of one edge, read per node (language Version 3): `edge[k].w` / `edge[k].rel` on arity cells (the
edge to child k, 0 where the node has none) and `edge.rel` / `edge.w` in a down cell on a tree (the edge to the
node's one parent, 0 at a root). An index read so chooses a row or matrix per node (`E[edge[k].rel]`,
`U[edge[k].rel] @ child[k].h`, `U[edge.rel] @ parent.h`), which reads 0 where there is no such edge.

Forward and every gradient (params and float edge inputs) on the interpreter, the compiled C and the emulated
CUDA against per-node float64 PyTorch written here, on shuffled-id trees with nodes of one child, SST trees,
chains, single nodes and `Forest.concat`; 1 and 2 threads bitwise; nvcc without spills."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from tests.helpers import (
    assert_packages_compile_with_nvcc_without_spills,
    digests_at_thread_counts,
    random_inputs,
    relative_error,
    shuffled_ids,
    sst_path,
)

torch = pytest.importorskip("torch")

DEVICES = ["interp", "cpu", "cuda-emu"]

#: a binary cell reading each child's edge: a float feature per side, a relation choosing a row and a matrix
BINARY = """
cell TypedBinary on tree(arity = 2) {
    dim X = 3, H = 4, R = 3, D = 2
    input x[X]
    input w[D] on edge
    input rel : index[R] on edge
    param W[H, X], V[H, D], E[R, H], U[R, H, H], b[H]
    state h[H]
    leaf { h = tanh(W @ x + b) }
    node {
        h = tanh(W @ x + V @ edge[0].w - 0.5 * V @ edge[1].w + E[edge[1].rel]
                 + U[edge[0].rel] @ child[0].h + U[edge[1].rel] @ child[1].h + edge[1].w[0:1] * b)
    }
}
"""

#: a down cell on a tree reading the edge to its parent: a relation choosing a row and a matrix, a float feature
DOWN = """
cell TypedDown on tree down {
    dim X = 3, H = 4, R = 3
    input x[X]
    input rel : index[R] on edge
    input w[1] on edge
    param W[H, X], E[R, H], U[R, H, H], b[H]
    state h[H]
    root { h = tanh(W @ x + b) }
    node { h = tanh(W @ x + E[edge.rel] + U[edge.rel] @ parent.h + edge.w * b + edge.siblings * b) }
}
"""


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("edge_at")
    built = {}
    for name, text in (("binary", BINARY), ("down", DOWN)):
        path = out / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        built[name] = cortexc.load(path, out_dir=out / name)
    return built


def _parents(forest: Forest) -> dict[int, tuple[int, int]]:
    """node -> (its parent, the forest's number of the edge between them)."""
    found = {}
    for parent in range(forest.num_nodes):
        start = int(forest.edge_ptr[parent])
        for place, child in enumerate(forest.children(parent)):
            found[int(child)] = (parent, start + place)
    return found


def _order(forest: Forest, down: bool) -> list[int]:
    """Every node after its children (or, `down`, after its parent)."""
    parents, done, seen = _parents(forest), [], set()
    for root in forest.roots:
        stack = [(int(root), False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                done.append(node)
            elif node not in seen:
                seen.add(node)
                stack.append((node, True))
                stack.extend((int(c), False) for c in forest.children(node))
    assert len(done) == forest.num_nodes and all(node in seen for node in parents)
    return list(reversed(done)) if down else done


def _binary_reference(forest: Forest, p: dict, x, w, rel) -> dict:
    hs = {}
    for node in _order(forest, down=False):
        kids = [int(c) for c in forest.children(node)]
        if not kids:
            hs[node] = torch.tanh(p["W"] @ x[node] + p["b"])
            continue
        first = int(forest.edge_ptr[node])
        total = p["W"] @ x[node]
        for k, sign in ((0, 1.0), (1, -0.5)):
            if k < len(kids):  # where there is no child k, edge[k].w and what edge[k].rel chooses read 0
                e = first + k
                total = total + sign * (p["V"] @ w[e]) + p["U"][int(rel[e])] @ hs[kids[k]]
                if k == 1:
                    total = total + p["E"][int(rel[e])] + w[e][0:1] * p["b"]
        hs[node] = torch.tanh(total)
    return {"h": torch.stack([hs[i] for i in range(forest.num_nodes)])}


def _down_reference(forest: Forest, p: dict, x, w, rel) -> dict:
    parents, hs = _parents(forest), {}
    for node in _order(forest, down=True):
        if node not in parents:
            hs[node] = torch.tanh(p["W"] @ x[node] + p["b"])
            continue
        parent, e = parents[node]
        r = int(rel[e])
        siblings = len(forest.children(parent))
        hs[node] = torch.tanh(p["W"] @ x[node] + p["E"][r] + p["U"][r] @ hs[parent] + w[e] * p["b"] + siblings * p["b"])
    return {"h": torch.stack([hs[i] for i in range(forest.num_nodes)])}


def _forests(kind: str, rng) -> dict[str, Forest]:
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    start = int(rng.integers(0, 300))
    trees = shuffled_ids(Forest.random(5, rng=rng, max_children=2, max_nodes=14), rng)  # nodes of 1 and 2 children
    if kind == "down":
        trees = shuffled_ids(Forest.random(5, rng=rng, max_children=4, max_nodes=20), rng)
    return {
        "shuffled": trees,
        "sst": Forest.from_ptb(lines[start : start + 6]),
        "chain": Forest.from_parents([-1, 0, 1, 2, 3]),
        "single": Forest.from_parents([-1]),
        "concat": Forest.concat([Forest.from_parents([-1]), trees, Forest.from_parents([-1, 0])]),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["binary", "down"])
def test_one_edges_inputs_match_per_node_torch(modules, kind, device):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    cls = modules[kind].TypedBinary if kind == "binary" else modules[kind].TypedDown
    reference = _binary_reference if kind == "binary" else _down_reference
    for shape, forest in _forests(kind, rng).items():
        model = cls(device=device, seed=int(rng.integers(1 << 30)))
        params = {k: (v + 0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()}
        model.load_params(params)
        inputs = random_inputs(cls.signature, forest, rng)
        out = model(forest, grad=True, **inputs)
        upstream = {"h": rng.standard_normal(out["h"].shape).astype(np.float32)}
        grads = model.backward(out, upstream)

        tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
        x = torch.tensor(inputs["x"], dtype=torch.float64)
        w = torch.tensor(inputs["w"], dtype=torch.float64, requires_grad=True)
        expected = reference(forest, tp, x, w, inputs["rel"])
        (expected["h"] * torch.tensor(upstream["h"], dtype=torch.float64)).sum().backward()
        where = f"{kind} {shape} {device} seed={seed}"
        assert relative_error(out["h"], expected["h"].detach().numpy()) < 1e-5, where
        for name, tensor in tp.items():
            want = np.zeros(tensor.shape) if tensor.grad is None else tensor.grad.numpy()  # unread on this forest
            assert relative_error(grads[name], want) < 1e-4, f"{name} {where}"
        want = np.zeros(w.shape) if w.grad is None else w.grad.numpy()  # a forest without edges
        assert grads["w"].shape == w.shape and relative_error(grads["w"], want) < 1e-4, f"w {where}"


WORKER = r"""
import json, sys
import numpy as np
import cortexc
from cortexc import Forest
module = cortexc.load(sys.argv[1], out_dir=sys.argv[2])
model = module.TypedBinary(device="cpu", seed=3)
rng = np.random.default_rng(5)
forest = Forest.random(60, rng=rng, max_children=2, max_nodes=40)
from tests.helpers import digest, random_inputs  # the worker runs in the checkout
out = model(forest, grad=True, **random_inputs(model.signature, forest, rng))
grads = model.backward(out, {"h": np.ones_like(out["h"])})
print(json.dumps(digest({**out, **{f"d_{name}": value for name, value in grads.items()}})))
"""


@pytest.mark.slow
def test_one_and_two_threads_give_the_same_bits(tmp_path):
    digests = digests_at_thread_counts(WORKER, BINARY, tmp_path)
    assert digests[0] == digests[1]


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cells_reading_one_edge_compile_with_nvcc_without_spills(modules):
    assert_packages_compile_with_nvcc_without_spills(modules.values())
