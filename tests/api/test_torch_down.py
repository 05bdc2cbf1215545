"""`cortexc.torch` with `down` cells (language Version 3): a top-down cell is a `CellModule` like any other,
its batch the reversed forest (`ForestBatch.from_forest(forest, down=True)`, or the Forest itself), with
`edge.position` / `edge.siblings` computed from the batch's tensors and edge inputs in the kernels' order.

The bidirectional Tree-LSTM of `examples/bitreelstm.cell` (a bottom-up cell, then a `down` cell fed its
`h`) against a per-node float64 PyTorch one written here, every gradient of both cells included; down cells
with positions, siblings, edge inputs and DAG reductions against the NumPy API (which `tests/language/test_down.py`
checks against per-node torch); `torch.compile(fullgraph=True)` over two sizes; opcheck; `torch.export`; and
the typed errors of a batch of the wrong direction or a forest the cell cannot read."""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import ForestError
from tests.api.test_torch_edges_graphs import _against_numpy
from tests.helpers import EXAMPLES, relative_error, shuffled_ids, sst_path
from tests.language.test_down import DAG_DOWN, DAG_EDGES, DOWN_LSTM, POSITIONS

torch = pytest.importorskip("torch")

from cortexc.torch import CellModule, ForestBatch  # noqa: E402
from cortexc.torch.keys import cell_key  # noqa: E402
from cortexc.torch.module import _kernel_rows  # noqa: E402
from cortexc.torch.ops import cell_forward  # noqa: E402

DIMS = {"V": 20, "X": 4, "H": 5, "C": 3}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_down")
    built = {"bi": cortexc.load(EXAMPLES / "bitreelstm.cell", out_dir=out / "bi", **DIMS)}
    for name, text in (("positions", POSITIONS), ("dag", DAG_EDGES), ("lstm", DOWN_LSTM), ("dagdown", DAG_DOWN)):
        path = out / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        built[name] = cortexc.load(path, out_dir=out / name)
    return built


def _sst(start: int, count: int) -> Forest:
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    return Forest.from_ptb(lines[start : start + count])


def _forests(rng) -> dict[str, Forest]:
    binary = shuffled_ids(Forest.random(6, rng=rng, binary=True, max_nodes=15), rng)
    return {
        "shuffled": binary,
        "single": Forest.from_parents([-1]),
        "sst": _sst(int(rng.integers(0, 200)), 8),
        "concat": Forest.concat([Forest.from_parents([-1]), binary, Forest.from_parents([2, 2, -1])]),
    }


# --------------------------------------------------------------------------- against the NumPy API
@pytest.mark.parametrize("shape", ["shuffled", "single", "sst", "concat"])
@pytest.mark.parametrize("name", ["positions", "lstm"])
def test_down_tree_cells_match_the_numpy_api(modules, name, shape):
    """Positions, siblings and an edge input (`positions`) and outputs at the roots (`lstm`): results and
    every gradient, edge input included, equal the NumPy API's on the same params."""
    rng = np.random.default_rng(np.random.SeedSequence().entropy % 2**31)
    cls = {"positions": modules["positions"].TopDown, "lstm": modules["lstm"].DownLSTM}[name]
    _against_numpy(cls, _forests(rng)[shape], rng)


@pytest.mark.parametrize("name", ["dag", "dagdown"])
def test_down_dag_cells_match_the_numpy_api(modules, name):
    """Per-parent reductions, typed edges and positions on a DAG with shared nodes and shuffled ids."""
    rng = np.random.default_rng(np.random.SeedSequence().entropy % 2**31)
    forest = shuffled_ids(Forest.random_dag(40, rng, max_children=4, max_parents=3), rng)
    cls = modules["dag"].DagEdges if name == "dag" else modules["dagdown"].DagDown
    _against_numpy(cls, forest, rng)
    _against_numpy(cls, forest, rng, batch=ForestBatch.from_forest(forest, down=True))


# --------------------------------------------------------------------------- the bidirectional Tree-LSTM
def _bi_reference(forest: Forest, up: dict, down: dict, word) -> dict:
    """The bidirectional Tree-LSTM per node in float64, written from `examples/bitreelstm.cell`'s equations."""
    H = DIMS["H"]
    sig, tanh = torch.sigmoid, torch.tanh
    hu, cu = {}, {}
    for node in _bottom_up(forest):
        kids = [int(k) for k in forest.children(node)]
        if not kids:
            g = up["W_x"] @ up["E"][word[node]] + up["b_x"]
            cu[node] = sig(g[:H]) * tanh(g[2 * H :])
        else:
            hc = torch.cat([hu[kids[0]], hu[kids[1]]])
            g = up["U"] @ hc + up["b_u"]
            f = sig(up["U_f"] @ hc + up["b_f"])
            cu[node] = sig(g[:H]) * tanh(g[2 * H :]) + f[:H] * cu[kids[0]] + f[H:] * cu[kids[1]]
        hu[node] = sig(g[H : 2 * H]) * tanh(cu[node])
    hd, cd = {}, {}
    parent_of = {int(c): p for p in range(forest.num_nodes) for c in forest.children(p)}
    for node in reversed(_bottom_up(forest)):
        g = down["W_x"] @ down["E"][word[node]] + down["W_u"] @ hu[node] + down["b"]
        parent = parent_of.get(node)
        if parent is not None:
            side = [int(c) for c in forest.children(parent)].index(node)
            g = g + down["U"][side] @ hd[parent]
        cd[node] = sig(g[:H]) * tanh(g[3 * H :])
        if parent is not None:
            cd[node] = cd[node] + sig(g[H : 2 * H]) * cd[parent]
        hd[node] = sig(g[2 * H : 3 * H]) * tanh(cd[node])
    order = range(forest.num_nodes)
    logits = torch.stack([down["W_s"] @ torch.cat([hd[v], hu[v]]) + down["b_s"] for v in order])
    return {"h": torch.stack([hd[v] for v in order]), "hu": torch.stack([hu[v] for v in order]), "logits": logits}


def _bottom_up(forest: Forest) -> list[int]:
    """Every node after its children."""
    done: list[int] = []
    seen: set[int] = set()
    for root in forest.roots:
        stack = [(int(root), False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                done.append(node)
                seen.add(node)
            elif node not in seen:
                stack.append((node, True))
                stack.extend((int(c), False) for c in forest.children(node))
    return done


@pytest.mark.parametrize("shape", ["shuffled", "sst", "concat"])
@pytest.mark.parametrize("chain", ["forest", "batches"])
def test_the_bidirectional_tree_lstm_matches_per_node_torch(modules, shape, chain):
    """The two cells chained in autograd's graph: results, and the gradients of every param of both cells,
    against the per-node float64 model (a loss on the logits and on the top-down h)."""
    rng = np.random.default_rng(np.random.SeedSequence().entropy % 2**31)
    forest = _forests(rng)[shape]
    if shape == "concat":  # the bidirectional cell is binary: one leaf and one binary tree
        forest = Forest.concat([Forest.from_parents([-1]), _forests(rng)["shuffled"]])
    bi = modules["bi"]
    up, down = CellModule(bi.BiTreeLSTMUp, seed=int(rng.integers(99))), CellModule(bi.BiTreeLSTMDown, seed=7)
    with torch.no_grad():
        for param in [*up.parameters(), *down.parameters()]:
            param.mul_(3.0)  # away from the small init, so that every gate matters
    word = torch.as_tensor(rng.integers(0, DIMS["V"], forest.num_nodes))
    if chain == "forest":
        first, second = forest, forest
    else:
        first, second = ForestBatch.from_forest(forest), ForestBatch.from_forest(forest, down=True)
    h_up = up(first, word=word)["h"]
    got = down(second, word=word, hu=h_up)
    d_logits = torch.randn(got["logits"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    d_h = torch.randn(got["h"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ((got["logits"] * d_logits.float()).sum() + (got["h"] * d_h.float()).sum()).backward()

    ref_up = {k: v.detach().double().requires_grad_(True) for k, v in up.named_parameters()}
    ref_down = {k: v.detach().double().requires_grad_(True) for k, v in down.named_parameters()}
    expected = _bi_reference(forest, ref_up, ref_down, word.tolist())
    ((expected["logits"] * d_logits).sum() + (expected["h"] * d_h).sum()).backward()
    assert relative_error(h_up.detach().numpy(), expected["hu"].detach().numpy()) < 1e-5
    for name in ("logits", "h"):
        assert relative_error(got[name].detach().numpy(), expected[name].detach().numpy()) < 1e-5, name
    for module, ref, which in ((up, ref_up, "up"), (down, ref_down, "down")):
        for name, param in module.named_parameters():
            error = relative_error(param.grad.numpy(), ref[name].grad.numpy())
            assert error < 1e-4, f"{which}.{name}: {error}"


# --------------------------------------------------------------------------- compiled graphs
def _positions_inputs(forest: Forest, rng) -> dict:
    return {
        "x": torch.tensor(rng.standard_normal((forest.num_nodes, 4)), dtype=torch.float32),
        "w": torch.tensor(rng.standard_normal((forest.num_edges, 2)), dtype=torch.float32),
    }


def test_torch_compile_runs_a_down_cell_without_graph_breaks(modules, rng):
    """fullgraph=True over forests of two sizes (positions, siblings and the edge input come from the batch's
    tensors); bitwise the eager results and gradients."""
    cls = modules["positions"].TopDown
    module = CellModule(cls, seed=3)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for size in (12, 30):
        forest = shuffled_ids(Forest.random(4, rng=rng, binary=True, max_nodes=size), rng)
        batch = ForestBatch.from_forest(forest, down=True)
        inputs = _positions_inputs(forest, rng)
        results = []
        for run in (module, compiled):
            given = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
            module.zero_grad()
            out = run(batch, **given)
            (out["h"].sum() + out["c"].square().sum()).backward()
            grads = [p.grad.clone() for p in module.parameters()] + [given["w"].grad, given["x"].grad]
            results.append([out["h"].detach(), out["c"].detach(), *grads])
        for eager, again in zip(*results):
            assert torch.equal(eager, again)


def test_opcheck_passes_on_a_down_cell(modules, rng):
    cls = modules["positions"].TopDown
    module = CellModule(cls, seed=0)
    forest = shuffled_ids(Forest.random(3, rng=rng, binary=True, max_nodes=9), rng)
    batch = ForestBatch.from_forest(forest, down=True)
    rows = _kernel_rows(cls.signature, batch, _positions_inputs(forest, rng))
    inputs = [rows[name] for name in module.runner.inputs]
    params = [getattr(module, n).detach().clone().requires_grad_(True) for n in module.runner.params]
    args = (cell_key(cls, "cpu"), params, inputs, *batch.tensors(), False, torch.zeros((), dtype=torch.int64))
    torch.library.opcheck(cell_forward, args)


def test_torch_export_runs_the_bidirectional_tree_lstm_on_other_forests(modules, rng):
    bi = modules["bi"]

    class Bi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = CellModule(bi.BiTreeLSTMUp, seed=1)
            self.down = CellModule(bi.BiTreeLSTMDown, seed=2)

        def forward(self, up_batch, down_batch, word):
            return self.down(down_batch, word=word, hu=self.up(up_batch, word=word)["h"])["logits"]

    def example(start: int, count: int):
        forest = _sst(start, count)
        word = torch.as_tensor(rng.integers(0, DIMS["V"], forest.num_nodes))
        return ForestBatch.from_forest(forest), ForestBatch.from_forest(forest, down=True), word

    net = Bi()
    nodes, edges = torch.export.Dim("nodes"), torch.export.Dim("edges")
    down_shapes = ForestBatch.dynamic_shapes(nodes, edges, prefix="down_")
    shapes = (ForestBatch.dynamic_shapes(nodes, edges), down_shapes, {0: nodes})
    program = torch.export.export(net, example(0, 5), dynamic_shapes=shapes)
    for start, count in ((40, 3), (100, 9)):
        args = example(start, count)
        bare = (ForestBatch(*args[0].leaves()), ForestBatch(*args[1].leaves()), args[2])
        assert torch.equal(program.module()(*bare), net(*args))


# --------------------------------------------------------------------------- errors
def test_a_batch_of_the_wrong_direction_is_a_typed_error(modules, rng):
    forest = Forest.random(3, rng=rng, binary=True, max_nodes=9)
    bi = modules["bi"]
    word = torch.zeros(forest.num_nodes, dtype=torch.long)
    up, down = CellModule(bi.BiTreeLSTMUp), CellModule(bi.BiTreeLSTMDown)
    hu = torch.zeros(forest.num_nodes, DIMS["H"])
    with pytest.raises(ForestError, match=r"down cell.*pass ForestBatch.from_forest\(forest, down=True\)"):
        down(ForestBatch.from_forest(forest), word=word, hu=hu)
    with pytest.raises(ForestError, match=r"bottom-up cell.*pass ForestBatch.from_forest\(forest\) "):
        up(ForestBatch.from_forest(forest, down=True), word=word)
    with pytest.raises(cortexc.InputError, match="not both"):
        ForestBatch.from_forest(forest, steps=2, down=True)


def test_a_compiled_graph_checks_the_forest_a_down_batch_reverses(modules):
    """A batch rebuilt from its leaves has no Forest: the op itself refuses a node with more children than the
    arity or the positions allow, and a shared node for a tree cell, naming the node (nothing computed)."""
    cls = modules["positions"].TopDown
    module = CellModule(cls)

    def run(forest: Forest):
        bare = ForestBatch(*ForestBatch.from_forest(forest, down=True).leaves())
        rng = np.random.default_rng(0)
        return module(bare, **_positions_inputs(forest, rng))

    with pytest.raises(ForestError, match="node 3 has 3 children but cell TopDown's arity is 2"):
        run(Forest.from_parents([3, 3, 3, -1]))
    with pytest.raises(ForestError, match="node 2 has 2 parents; cell TopDown is on a tree"):
        run(Forest(np.array([0, 1, 2, 2, 4]), np.array([2, 2, 0, 1])))
    dag = modules["dag"].DagEdges
    wide = Forest.from_parents([5, 5, 5, 5, 5, -1])  # P[edge.position] holds 4 matrices
    rel = torch.zeros(wide.num_edges, dtype=torch.long)
    bare = ForestBatch(*ForestBatch.from_forest(wide, down=True).leaves())
    inputs = {"x": torch.zeros(6, 4), "rel": rel, "w": torch.zeros(wide.num_edges, 1)}
    with pytest.raises(ForestError, match=r"node 5 has 5 children but P\[edge.position\] of cell DagEdges chooses"):
        CellModule(dag)(bare, **inputs)


# --------------------------------------------------------------------------- the training example
def test_the_bidirectional_example_trains_on_sst(tmp_path, capsys):
    """`examples/train_bitreelstm_torch.py` on a few SST trees: the loss falls over three epochs, the best
    state_dict (both cells) is saved and its command line runs."""
    sst_path("train")
    spec = importlib.util.spec_from_file_location("train_bitreelstm_torch", EXAMPLES / "train_bitreelstm_torch.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    save = tmp_path / "bi.pt"
    small = dict(limit=120, eval_limit=40, hidden=8, embed=8, batch=25, lr=0.05, seed=3)
    best, losses = example.train(argparse.Namespace(cell=EXAMPLES / "bitreelstm.cell", epochs=3, save=save, **small))
    assert losses[-1] < losses[0] * 0.9, losses
    assert 0.0 <= best <= 1.0
    printed = capsys.readouterr().out
    assert printed.count("; dev root acc") == 3 and "best dev root accuracy" in printed
    state = torch.load(save)
    assert {k.split(".")[0] for k in state} == {"up", "down"} and tuple(state["down.U"].shape) == (2, 32, 8)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in small.items()]
    assert example.main([*flags, "--epochs=1", f"--save={tmp_path / 'again.pt'}"]) == 0
    assert (tmp_path / "again.pt").exists()
