"""The PyTorch peers of the Version 3 benchmarks compute the very cells cortexc compiles.

`benchmarks/bench_topdown.py` (top-down Tree-LSTM), `benchmarks/bench_rntn.py` (RNTN) and
`benchmarks/bench_daglstm.py` (typed DAG-LSTM) time cortexc against hand-written PyTorch; a ratio means
something only if both compute the same thing. Here, at tiny dims, every peer's outputs and every gradient it
gives (weights, and the float inputs where cortexc returns them) match cortexc's compiled CPU cell, to 1e-4
relative to the largest value; and a peer given the wrong structure (sides or relations swapped) is caught by
the same comparison, so the check is not vacuous. The SST cases skip when the data is absent.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import bench_daglstm, bench_rntn, bench_topdown  # noqa: E402
from cortexc import Forest, Vocab  # noqa: E402
from tests.helpers import relative_error, sst_path  # noqa: E402

TOL = 1e-4


def _sst_lines(split: str, count: int) -> list[str]:
    lines = []
    with sst_path(split).open(encoding="utf-8") as text:
        for line in text:
            if line.strip():
                lines.append(line)
            if len(lines) == count:
                break
    return lines


def _assert_close(got: dict, want: dict, names, what: str) -> None:
    for name in names:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert a.shape == b.shape, f"{what}: {name} shape {a.shape} against {b.shape}"
        assert relative_error(a, b) < TOL, f"{what}: {name} differs by {relative_error(a, b):.2e}"


def _numpy(outputs: dict) -> dict:
    return {k: v.numpy() for k, v in outputs.items()}


# ------------------------------------------------------------------ top-down Tree-LSTM


@pytest.fixture(scope="module")
def topdown(tmp_path_factory):
    H, X = 8, 6
    model = bench_topdown.load_cell(tmp_path_factory.mktemp("topdown"), H, X)(device="cpu", seed=0)
    params = bench_topdown.random_params({k: np.shape(v) for k, v in model.params.items()}, H, np.random.default_rng(1))
    model.load_params(params)
    return model, params, X


def test_topdown_peers_match_cortexc(topdown):
    model, params, X = topdown
    level, node = bench_topdown.LevelTopDown(params), bench_topdown.PerNodeTopDown(params)
    batch = bench_topdown.make_batch(_sst_lines("dev", 6), level, node, X, seed=2)
    out = model(batch.forest, x=batch.x)
    want = bench_topdown.cortexc_grads(model, batch.forest, batch.x)
    tx = torch.from_numpy(batch.x)
    for name, peer, plan in (("level", level, batch.level), ("per_node", node, batch.node)):
        _assert_close(_numpy(peer.infer(plan, tx)), out, ("h", "c", "logits"), name)
        _assert_close(bench_topdown.torch_grads(peer, plan, batch.x), want, (*bench_topdown.PARAMS, "x"), name)


def test_topdown_level_plan_orders_depths_and_sides():
    """Rows by depth from the root; a depth's left children before its right ones; parents one depth up."""
    forest = Forest.from_parents([2, 2, 4, 4, -1, 6, -1])  # a tree of 5 and a chain of 2
    np.testing.assert_array_equal(bench_topdown.depths(forest), [2, 2, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(bench_topdown.positions(forest), [0, 1, 0, 1, 0, 0, 0])
    shapes = {"W": (8, 3), "U": (2, 8, 2), "b": (8,), "W_s": (5, 2), "b_s": (5,)}
    level = bench_topdown.LevelTopDown(bench_topdown.random_params(shapes, 2, np.random.default_rng(0)))
    plan = level.prepare(forest)
    assert plan.level_ptr == (0, 2, 5, 7)
    assert plan.sides == ((2, 1), (1, 1))
    order = plan.order.tolist()
    assert order[:2] == [4, 6] and order[2:5] == [2, 5, 3] and order[5:] == [0, 1]


def test_topdown_swapped_sides_are_caught(topdown):
    model, params, X = topdown
    swapped = {**params, "U": params["U"][::-1].copy()}
    level, node = bench_topdown.LevelTopDown(swapped), bench_topdown.PerNodeTopDown(swapped)
    batch = bench_topdown.make_batch(_sst_lines("dev", 3), level, node, X, seed=3)
    out = model(batch.forest, x=batch.x)
    assert relative_error(level.infer(batch.level, torch.from_numpy(batch.x))["h"].numpy(), out["h"]) > 1e-2


# ------------------------------------------------------------------ RNTN


@pytest.fixture(scope="module")
def rntn(tmp_path_factory):
    lines = _sst_lines("dev", 8)
    vocab = Vocab.build([Forest.from_ptb(lines)])
    model = bench_rntn.load_cell(tmp_path_factory.mktemp("rntn"), 5, len(vocab))(device="cpu", seed=0)
    params = bench_rntn.random_params({k: np.shape(v) for k, v in model.params.items()}, np.random.default_rng(4))
    model.load_params(params)
    return model, params, vocab, lines


def test_rntn_peers_match_cortexc(rntn):
    model, params, vocab, lines = rntn
    level, node = bench_rntn.LevelRNTN(params), bench_rntn.PerNodeRNTN(params)
    batch = bench_rntn.make_batch(lines, vocab, level, node)
    out = model(batch.forest, word=batch.words)
    want = bench_rntn.cortexc_grads(model, batch.forest, batch.words)
    for name, peer, plan in (("level", level, batch.level), ("per_node", node, batch.node)):
        _assert_close(_numpy(peer.infer(plan)), out, ("h", "logits"), name)
        _assert_close(bench_rntn.torch_grads(peer, plan), want, bench_rntn.PARAMS, name)


def test_rntn_swapped_children_are_caught(rntn):
    model, params, vocab, lines = rntn
    d = params["b"].shape[0]
    swapped = {**params, "W": np.concatenate([params["W"][:, d:], params["W"][:, :d]], axis=1)}
    level, node = bench_rntn.LevelRNTN(swapped), bench_rntn.PerNodeRNTN(swapped)
    batch = bench_rntn.make_batch(lines[:3], vocab, level, node)
    out = model(batch.forest, word=batch.words)
    assert relative_error(level.infer(batch.level)["h"].numpy(), out["h"]) > 1e-2
    assert relative_error(node.infer(batch.node)["h"].numpy(), out["h"]) > 1e-2


# ------------------------------------------------------------------ typed DAG-LSTM


@pytest.fixture(scope="module")
def daglstm(tmp_path_factory):
    args = bench_daglstm._parse(["--input", "5", "--hidden", "6", "--relations", "4", "--edge-features", "3"])
    model = bench_daglstm.load_cell(tmp_path_factory.mktemp("daglstm"), 5, 6, 4, 3)(device="cpu", seed=0)
    params = bench_daglstm.random_params({k: np.shape(v) for k, v in model.params.items()}, 6, np.random.default_rng(5))
    model.load_params(params)
    return model, params, args


@pytest.mark.parametrize("nodes", [1, 40, 150])
def test_daglstm_peer_matches_cortexc(daglstm, nodes):
    model, params, args = daglstm
    case = bench_daglstm.Case(model, bench_daglstm.LevelDagLSTM(params), nodes, args, seed=nodes)
    _assert_close(_numpy(case.level_infer()), case.cortexc_infer(), ("h", "c"), f"{nodes} nodes")
    _assert_close(case.level_train(), case.cortexc_train(), (*bench_daglstm.PARAMS, "x", "w"), f"{nodes} nodes")


def test_daglstm_shuffled_relations_are_caught(daglstm):
    model, params, args = daglstm
    shuffled = {**params, "U": np.roll(params["U"], 1, axis=0), "U_f": np.roll(params["U_f"], 1, axis=0)}
    case = bench_daglstm.Case(model, bench_daglstm.LevelDagLSTM(shuffled), 60, args, seed=7)
    assert relative_error(case.level_infer()["h"].numpy(), case.cortexc_infer()["h"]) > 1e-2
