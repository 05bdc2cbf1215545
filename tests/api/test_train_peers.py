"""The PyTorch training peers and cortexc's compiled backward compute the same gradients.

`benchmarks/bench_train.py` compares training throughput and accuracy of
cortexc against `benchmarks/train_peers.py`; that only means something if all
three differentiate the very same loss: the mean over every node of the
softmax cross-entropy of the binary Tree-LSTM's logits. Small dims (H=8,
X=6), ~30 SST trees, every param random (biases too), float32 throughout.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cortexc  # noqa: E402
from benchmarks.train_peers import TorchLevelBatchedTrain, TorchPerNodeTrain  # noqa: E402
from cortexc.runtime.forest import Forest  # noqa: E402
from cortexc.runtime.vocab import Vocab  # noqa: E402
from cortexc.train import softmax_cross_entropy  # noqa: E402
from tests.helpers import EXAMPLES, relative_error, sst_path  # noqa: E402

RTOL = 1e-4
TREES = 30
DIMS = {"H": 8, "X": 6, "C": 5}


@pytest.fixture(scope="module")
def setup():
    """SST trees as one forest, word ids, labels, and the compiled model with random params."""
    with open(sst_path("train"), encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()][:TREES]
    forest = Forest.from_ptb(lines)
    vocab = Vocab.build([forest])
    ids = vocab.encode(forest)
    module = cortexc.load(str(EXAMPLES / "binary_treelstm.cell"), V=len(vocab), **DIMS)
    model = module.BinaryTreeLSTM(device="cpu", seed=0)
    rng = np.random.default_rng(1234)
    params = {name: rng.normal(0.0, 0.5, value.shape).astype(np.float32) for name, value in model.params.items()}
    model.load_params(params)
    return forest, ids, np.asarray(forest.labels), model, params


def cortexc_grads(model, forest, ids, labels) -> tuple[float, dict[str, np.ndarray]]:
    out = model(forest, grad=True, word=ids)
    loss, d_logits = softmax_cross_entropy(out["logits"], labels)
    return loss, model.backward(out, {"logits": d_logits})


@pytest.mark.parametrize("peer_class", [TorchLevelBatchedTrain, TorchPerNodeTrain])
def test_grads_match_cortexc(setup, peer_class):
    forest, ids, labels, model, params = setup
    _, ref = cortexc_grads(model, forest, ids, labels)
    got = peer_class(params).grads(forest, ids, labels)
    assert set(got) == set(ref)
    errors = {name: relative_error(got[name], ref[name]) for name in ref}
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert np.abs(ref[name]).max() > 0, f"cortexc's gradient of {name} is all zeros"
    bad = {name: f"{err:.2e}" for name, err in errors.items() if err > RTOL}
    assert not bad, f"{peer_class.__name__} vs cortexc compiled: relative errors above {RTOL}: {bad}"


def test_peers_agree_with_each_other(setup):
    forest, ids, labels, _, params = setup
    level = TorchLevelBatchedTrain(params).grads(forest, ids, labels)
    per_node = TorchPerNodeTrain(params).grads(forest, ids, labels)
    for name in level:
        assert relative_error(per_node[name], level[name]) <= RTOL, name


def test_loss_and_logits_match_cortexc(setup):
    forest, ids, labels, model, params = setup
    ref_logits = model(forest, word=ids)["logits"]
    ref_loss, _ = softmax_cross_entropy(ref_logits, labels)
    for peer_class in (TorchLevelBatchedTrain, TorchPerNodeTrain):
        peer = peer_class(params)
        assert relative_error(peer.logits(forest, ids), ref_logits) <= RTOL, peer_class.__name__
        with torch.no_grad():
            loss = float(peer.loss(peer.prepare(forest, ids, labels)))
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), peer_class.__name__


def test_step_trains(setup):
    """Adagrad steps on one batch lower its loss, and `grads` takes no step."""
    forest, ids, labels, _, params = setup
    for peer_class in (TorchLevelBatchedTrain, TorchPerNodeTrain):
        peer = peer_class(params, lr=0.05)
        peer.grads(forest, ids, labels)
        assert all(np.array_equal(value, params[name]) for name, value in peer.numpy_params().items())
        losses = [peer.step(forest, ids, labels) for _ in range(4)]
        assert all(np.isfinite(losses)), losses
        assert losses[-1] < losses[0], f"{peer_class.__name__}: {losses}"


def test_missing_child_reads_zeros():
    """A node with one child (not in SST) reads zeros for the other, in both peers alike."""
    forest = Forest.from_parents([2, 2, 4, 4, -1, 6, -1])  # node 6 has a single child (5)
    rng = np.random.default_rng(0)
    h, x, v, c = 4, 3, 7, 5
    params = {
        "E": rng.normal(size=(v, x)),
        "W_iou": rng.normal(size=(3 * h, x)),
        "b_iou": rng.normal(size=3 * h),
        "U_iou": rng.normal(size=(3 * h, 2 * h)),
        "U_f": rng.normal(size=(2 * h, 2 * h)),
        "b_f": rng.normal(size=2 * h),
        "W_s": rng.normal(size=(c, h)),
        "b_s": rng.normal(size=c),
    }
    ids = np.array([1, 2, 0, 3, 0, 4, 0])
    labels = np.array([0, 1, 2, 3, 4, 0, 1])
    level = TorchLevelBatchedTrain(params).grads(forest, ids, labels)
    per_node = TorchPerNodeTrain(params).grads(forest, ids, labels)
    for name in level:
        assert relative_error(per_node[name], level[name]) <= 1e-5, name
