"""The benchmark's PyTorch peers compute the same Tree-LSTM as cortexc's interpreter.

`benchmarks/peers.py` is only worth comparing against if it runs the very cell
of `examples/binary_treelstm.cell`: same params, same forest, same word ids,
same h, c and logits in node order. Small dims keep this fast; every param,
biases included, is random so that a bias or gate-order slip shows.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks.peers import (  # noqa: E402
    TorchLevelBatched,
    TorchPerNode,
    TreeDims,
    forward_flops,
    level_gemm_shapes,
    matmul_roofline,
)
from cortexc import reference  # noqa: E402
from cortexc.frontend import lower_source  # noqa: E402
from cortexc.runtime.forest import Forest  # noqa: E402
from cortexc.runtime.vocab import Vocab  # noqa: E402
from tests.helpers import EXAMPLES, relative_error, sst_path  # noqa: E402

RTOL = 1e-5
SST_TREES = 50
V = 40
PEERS = [TorchPerNode, TorchLevelBatched]


def small_cell(vocab_size: int = V):
    path = EXAMPLES / "binary_treelstm.cell"
    return lower_source(path.read_text(), str(path), defines={"H": 16, "X": 8, "V": vocab_size})[0]


def random_params(cell, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every param random (biases too, unlike the declared zeros), float32."""
    return {d.name: rng.normal(0.0, 0.5, d.shape).astype(np.float32) for d in cell.params}


def assert_matches_interp(peer_class, cell, params, forest: Forest, ids: np.ndarray) -> None:
    ref = reference.run(cell, forest, params, {"word": ids})
    out = peer_class(params)(forest, ids)
    for key in ("h", "c", "logits"):
        assert out[key].shape == ref[key].shape, f"{peer_class.__name__} {key}: shape"
        assert out[key].dtype == np.float32, f"{peer_class.__name__} {key}: dtype {out[key].dtype}"
        err = relative_error(out[key], ref[key])
        assert err <= RTOL, f"{peer_class.__name__} {key}: relative error {err:.2e} > {RTOL}"


@pytest.fixture(scope="module")
def sst_batch() -> tuple[Forest, np.ndarray]:
    """The first SST dev trees and their word ids, clipped into a small vocabulary."""
    with open(sst_path("dev"), encoding="utf-8") as handle:
        lines = [next(handle) for _ in range(SST_TREES)]
    forest = Forest.from_ptb(lines)
    ids = np.minimum(Vocab.build([forest]).encode(forest), V - 1).astype(np.int32)
    return forest, ids


@pytest.mark.parametrize("peer_class", PEERS, ids=lambda c: c.__name__)
def test_peer_matches_interp_on_sst(peer_class, sst_batch, rng):
    forest, ids = sst_batch
    cell = small_cell()
    assert_matches_interp(peer_class, cell, random_params(cell, rng), forest, ids)


@pytest.mark.parametrize("peer_class", PEERS, ids=lambda c: c.__name__)
def test_peer_matches_interp_on_random_binary_forest(peer_class, rng):
    forest = Forest.random(30, rng, binary=True, max_nodes=41, vocab_size=V)
    ids = rng.integers(0, V, forest.num_nodes).astype(np.int32)
    cell = small_cell()
    assert_matches_interp(peer_class, cell, random_params(cell, rng), forest, ids)


@pytest.mark.parametrize("peer_class", PEERS, ids=lambda c: c.__name__)
def test_peer_reads_zero_for_a_missing_child(peer_class, rng):
    """A node with one child reads zeros as its child[1], as the language defines; a lone leaf is a tree."""
    # Tree 1: 0 <- 1 <- 3, 2 <- 3 with node 1 unary; tree 2: the single leaf 4.
    forest = Forest.from_parents(np.array([1, 3, 3, -1, -1]))
    ids = rng.integers(0, V, forest.num_nodes).astype(np.int32)
    cell = small_cell()
    assert_matches_interp(peer_class, cell, random_params(cell, rng), forest, ids)


@pytest.mark.parametrize("peer_class", PEERS, ids=lambda c: c.__name__)
def test_peer_rejects_bad_input(peer_class, rng):
    cell = small_cell()
    peer = peer_class(random_params(cell, rng))
    forest = Forest.random(3, rng, binary=True, max_nodes=9)
    with pytest.raises(ValueError, match="outside"):
        peer(forest, np.full(forest.num_nodes, V, dtype=np.int32))
    wide = Forest.from_parents(np.array([3, 3, 3, -1]))
    with pytest.raises(ValueError, match="arity is 2"):
        peer(wide, np.zeros(wide.num_nodes, dtype=np.int32))


def test_flops_and_gemm_shapes_agree(rng):
    """The FLOP count is the FLOPs of the level-batch GEMMs, so "fraction of roofline" compares like with like."""
    cell = small_cell()
    dims = TreeDims.of(random_params(cell, rng))
    assert dims == TreeDims(V=V, X=8, H=16, C=5)
    forest = Forest.random(12, rng, binary=True, max_nodes=25)
    shapes = level_gemm_shapes(forest, dims)
    assert shapes[0] == (int(np.count_nonzero(forest.num_children == 0)), 8, 48)
    assert sum(m for m, k, n in shapes[1:-1]) == int(np.count_nonzero(forest.num_children > 0))
    assert shapes[-1] == (forest.num_nodes, 16, 5)
    assert forward_flops(forest, dims) == sum(2 * m * k * n for m, k, n in shapes)
    assert matmul_roofline(shapes[:2], repeats=1) > 0


def test_level_batched_attentive_peer_matches_the_interpreter(rng):
    """The attentive Tree-LSTM's level-batched torch peer (bench_attention) on trees of 0 to 5 children."""
    from benchmarks.peers import TorchLevelBatchedAttn
    from cortexc.runtime.params import init_params

    source = (EXAMPLES / "attn_treelstm.cell").read_text(encoding="utf-8")
    cell = lower_source(source, "attn_treelstm.cell", defines={"X": 6, "H": 5})[0]
    params = {k: v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in init_params(cell, 0).items()}
    forest = Forest.concat([Forest.random(8, rng=rng, max_children=5, max_nodes=20), Forest.from_parents([-1])])
    x = rng.standard_normal((forest.num_nodes, 6)).astype(np.float32)
    expected = reference.run(cell, forest, params, {"x": x})
    got = TorchLevelBatchedAttn(params)(forest, x)
    for name in ("h", "c"):
        assert relative_error(got[name], expected[name]) < 1e-5, name
