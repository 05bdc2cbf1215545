"""`cortexc.torch` with edge inputs (a DAG with typed, weighted edges) and graph cells (the GGNN of
`examples/ggnn.cell`): forward and every gradient against the NumPy API on the same params (which the
language tests check against per-node torch), `torch.compile(fullgraph=True)` over forests of two sizes,
and the typed errors of a wrong batch or input."""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import ForestError, InputError
from tests.helpers import EXAMPLES, random_graph, relative_error, shuffled_ids
from tests.language.test_edge_inputs import TYPED_DAG

torch = pytest.importorskip("torch")

from cortexc.torch import CellModule, ForestBatch  # noqa: E402


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_edges")
    path = out / "typed.cell"
    path.write_text(TYPED_DAG, encoding="utf-8")
    return {
        "dag": cortexc.load(path, out_dir=out / "dag"),
        "ggnn": cortexc.load(EXAMPLES / "ggnn.cell", out_dir=out / "ggnn", X=5, H=6, T=3),
    }


def _inputs(sig, forest: Forest, rng) -> dict[str, np.ndarray]:
    inputs = {}
    for decl in sig.inputs:
        if decl.given_by:  # a down cell's edge.position / edge.siblings: the runtime's
            continue
        rows = forest.num_edges if decl.on_edge else forest.num_nodes
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, rows)
        else:
            inputs[decl.name] = rng.standard_normal((rows, *decl.shape)).astype(np.float32)
    return inputs


def _against_numpy(cls, forest: Forest, rng, batch=None) -> None:
    """The module's results and gradients (params and float inputs, edge inputs included) equal the NumPy
    API's on the same params, for upstream gradients on every state and output."""
    inputs = _inputs(cls.signature, forest, rng)
    model = cls(device="cpu", seed=int(rng.integers(1 << 30)))
    expected = model(forest, grad=True, **inputs)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
    grads = model.backward(expected, upstream)
    module = CellModule(cls, seed=0)
    module.load_state_dict({k: torch.tensor(v) for k, v in model.params.items()})
    tensors = {
        k: torch.tensor(v) if v.dtype.kind != "f" else torch.tensor(v, requires_grad=True) for k, v in inputs.items()
    }
    got = module(forest if batch is None else batch, **tensors)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].shape == value.shape, name
        assert relative_error(got[name].detach().numpy(), value) < 1e-6, name
    sum((got[k] * torch.tensor(g)).sum() for k, g in upstream.items()).backward()
    for name, param in module.named_parameters():
        assert relative_error(param.grad.numpy(), grads[name]) < 1e-5, name
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            assert relative_error(tensor.grad.numpy(), grads[name]) < 1e-5, name


def test_edge_inputs_on_a_dag_match_the_numpy_api(modules, rng):
    """Edge inputs reach the kernels in their child-edge order, computed from the batch's tensors (ids
    shuffled, so level order is not id order), and their gradients come back in the forest's edge order."""
    forest = shuffled_ids(Forest.random_dag(40, rng, max_children=4, max_parents=3), rng)
    _against_numpy(modules["dag"].TypedDag, forest, rng)


def test_a_graph_cell_matches_the_numpy_api(modules, rng):
    """The GGNN on graphs with cycles, self-loops and repeated edges, and on a tree (any forest is a graph)."""
    cls = modules["ggnn"].GGNN
    _against_numpy(cls, random_graph(15, 25, rng), rng)
    _against_numpy(cls, Forest.concat([random_graph(6, 4, rng), Forest.random(3, rng, max_nodes=9)]), rng)
    graph = random_graph(9, 9, rng)
    _against_numpy(cls, graph, rng, batch=ForestBatch.from_forest(graph, steps=3))


@pytest.mark.slow
def test_torch_compile_fullgraph_runs_graph_and_edge_cells_on_new_sizes(modules, rng):
    """One compiled graph (no break) serves forests of other sizes and gives the eager results."""
    for cls, forests, steps in (
        (modules["ggnn"].GGNN, [random_graph(12, 20, rng), random_graph(30, 45, rng)], 3),
        (modules["dag"].TypedDag, [Forest.random_dag(n, rng, max_children=3, max_parents=2) for n in (20, 35)], 0),
    ):
        module = CellModule(cls, seed=1)
        compiled = torch.compile(module, fullgraph=True)
        for forest in forests:
            tensors = {k: torch.tensor(v) for k, v in _inputs(cls.signature, forest, rng).items()}
            batch = ForestBatch.from_forest(forest, steps=steps)
            eager, again = module(batch, **tensors), compiled(batch, **tensors)
            for name in eager:
                assert torch.equal(eager[name], again[name]), name


def test_a_graph_cell_needs_its_unrolled_batch_and_edge_rows(modules, rng):
    cls = modules["ggnn"].GGNN
    module = CellModule(cls, seed=0)
    graph = random_graph(8, 6, rng)
    tensors = {k: torch.tensor(v) for k, v in _inputs(cls.signature, graph, rng).items()}
    with pytest.raises(ForestError, match=r"ForestBatch.from_forest\(forest, steps=3\)"):
        module(ForestBatch(*ForestBatch.from_forest(Forest.random(2, rng, max_nodes=4)).leaves()), **tensors)
    with pytest.raises(InputError, match=rf"input rel must have shape \({graph.num_edges},\) \(one index per edge\)"):
        module(graph, **dict(tensors, rel=tensors["rel"][:-1]))
    bad = tensors["rel"].clone()
    bad[2] = 7
    edge = f"edge 2 \\(node {int(graph.edge_child[2])} -> node {int(graph.edge_parent[2])}\\)"
    with pytest.raises(InputError, match=rf"input rel: {edge} has index 7, outside \[0, 3\)"):
        module(graph, **dict(tensors, rel=bad))
    with pytest.raises(InputError, match=r"input x must have shape \(8, 5\) \(one row per node\)"):
        module(graph, **dict(tensors, x=torch.zeros(9, 5)))
