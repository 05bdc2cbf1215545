"""`cortexc.train`: optimizers and cross-entropy against torch, and a short SST training run."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import cortexc
from cortexc.errors import InputError
from cortexc.runtime.forest import Forest
from cortexc.runtime.vocab import Vocab
from cortexc.train import SGD, Adagrad, Adam, accuracy, batches, softmax_cross_entropy
from tests.helpers import EXAMPLES, relative_error, sst_path

SHAPES = {"W": (4, 3), "b": (4,), "E": (6, 2)}


def run_torch(torch, make_opt, params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], dtype):
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    tensors = {k: torch.nn.Parameter(torch.tensor(v, dtype=tdtype)) for k, v in params.items()}
    opt = make_opt(list(tensors.values()))
    history = []
    for step in grads:
        opt.zero_grad()
        for k, t in tensors.items():
            t.grad = torch.tensor(step[k], dtype=tdtype)
        opt.step()
        history.append({k: t.detach().numpy().copy() for k, t in tensors.items()})
    return history


def run_ours(opt, params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]]):
    history = []
    for step in grads:
        params = opt.step(params, step)
        history.append(params)
    return history


OPTIMIZERS = {
    "sgd": (lambda: SGD(0.1), lambda t, ps: t.optim.SGD(ps, lr=0.1)),
    "sgd_momentum": (lambda: SGD(0.05, momentum=0.9), lambda t, ps: t.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "sgd_weight_decay": (
        lambda: SGD(0.05, momentum=0.5, weight_decay=0.01),
        lambda t, ps: t.optim.SGD(ps, lr=0.05, momentum=0.5, weight_decay=0.01),
    ),
    "adagrad": (lambda: Adagrad(0.05), lambda t, ps: t.optim.Adagrad(ps, lr=0.05)),
    "adagrad_init_acc": (
        lambda: Adagrad(0.1, eps=1e-6, initial_accumulator=0.1),
        lambda t, ps: t.optim.Adagrad(ps, lr=0.1, eps=1e-6, initial_accumulator_value=0.1),
    ),
    "adam": (lambda: Adam(1e-2), lambda t, ps: t.optim.Adam(ps, lr=1e-2)),
    "adam_betas": (
        lambda: Adam(3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda t, ps: t.optim.Adam(ps, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_torch(name, dtype, rng):
    torch = pytest.importorskip("torch")
    ours, theirs = OPTIMIZERS[name]
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()} for _ in range(5)]
    grads[2]["E"][1] = 0.0  # a row that gets no gradient at one step (like an unused embedding)
    expected = run_torch(torch, lambda ps: theirs(torch, ps), params, grads, dtype)
    got = run_ours(ours(), params, grads)
    for step, (g, e) in enumerate(zip(got, expected)):
        for k in params:
            assert g[k].dtype == np.dtype(dtype), (k, g[k].dtype)
            np.testing.assert_allclose(
                g[k], e[k], rtol=1e-6, atol=1e-6 * max(1.0, np.abs(e[k]).max()), err_msg=f"{name} step {step} {k}"
            )


def test_optimizer_returns_new_arrays_and_accepts_read_only_params(rng):
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    for array in params.values():
        array.flags.writeable = False
    before = {k: v.copy() for k, v in params.items()}
    grads = {"W": np.ones(SHAPES["W"], np.float32)}  # only W has a gradient
    for opt in (SGD(0.1, momentum=0.9), Adagrad(0.1), Adam(0.1)):
        new = opt.step(params, grads)
        assert set(new) == set(params)
        for k in params:
            np.testing.assert_array_equal(params[k], before[k])
            assert new[k] is not params[k]
        assert not np.array_equal(new["W"], params["W"])
        np.testing.assert_array_equal(new["b"], params["b"])


def test_optimizer_rejects_unknown_names_and_wrong_shapes():
    params = {"W": np.zeros((2, 2), np.float32)}
    with pytest.raises(InputError, match="V"):
        SGD(0.1).step(params, {"V": np.zeros((2, 2))})
    with pytest.raises(InputError, match="W"):
        Adam().step(params, {"W": np.zeros(2)})
    with pytest.raises(ValueError):
        SGD(0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_cross_entropy_matches_torch(dtype, rng):
    torch = pytest.importorskip("torch")
    logits = (3 * rng.standard_normal((17, 5))).astype(dtype)
    logits[3] += 40  # large logits stay finite
    labels = rng.integers(0, 5, 17)
    loss, grad = softmax_cross_entropy(logits, labels)
    assert grad.dtype == np.dtype(dtype) and grad.shape == logits.shape
    t = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(t, torch.tensor(labels))
    ref.backward()
    tol = 1e-6 if dtype == np.float32 else 1e-12
    assert abs(loss - ref.item()) <= tol * max(1.0, abs(ref.item()))
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=tol, atol=tol)
    total, grad_sum = softmax_cross_entropy(logits, labels, reduction="sum")
    assert abs(total - 17 * loss) <= 1e-5 * total
    np.testing.assert_allclose(grad_sum, 17 * grad, rtol=1e-5, atol=1e-6)


def test_softmax_cross_entropy_errors_and_empty():
    with pytest.raises(InputError, match="outside"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(InputError, match="shape"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0, 1, 2]))
    with pytest.raises(InputError, match="integers"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0.0, 1.0]))
    loss, grad = softmax_cross_entropy(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    assert loss == 0.0 and grad.shape == (0, 3)


def test_accuracy_and_batches(rng):
    logits = np.array([[0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    assert accuracy(logits, np.array([1, 0, 0])) == pytest.approx(2 / 3)
    items = list(range(53))
    fixed = list(batches(items, 25))
    assert [len(b) for b in fixed] == [25, 25, 3] and sum(fixed, []) == items
    shuffled = list(batches(items, 25, rng))
    assert sorted(sum(shuffled, [])) == items and [len(b) for b in shuffled] == [25, 25, 3]


@pytest.mark.slow
def test_short_sst_training_run_lowers_the_loss():
    """Binary Tree-LSTM (H = X = 16) on 200 SST train trees, 3 epochs, Adagrad 0.05, batch 25,
    per-node cross-entropy, device="interp": the last epoch's mean loss is below the first's."""
    path = sst_path("train")
    with open(path, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()][:200]
    trees = [Forest.from_ptb(line) for line in lines]
    vocab = Vocab.build(trees)
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", V=len(vocab), X=16, H=16)
    model = module.BinaryTreeLSTM(device="interp", seed=0)
    opt = Adagrad(0.05)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    epoch_losses = []
    for _ in range(3):
        losses = []
        for batch in batches(trees, 25, rng):
            forest = Forest.concat(batch)
            out = model(forest, grad=True, word=vocab.encode(forest))
            loss, d_logits = softmax_cross_entropy(out["logits"], forest.labels)
            grads = model.backward(out, {"logits": d_logits})
            model.load_params(opt.step(model.params, grads))
            losses.append(loss)
        epoch_losses.append(float(np.mean(losses)))
    elapsed = time.perf_counter() - start
    print(f"epoch losses {epoch_losses} in {elapsed:.1f}s")
    assert all(np.isfinite(epoch_losses))
    assert epoch_losses[-1] < epoch_losses[0] - 0.05, epoch_losses


# ----------------------------------------------------------------------------- Treebank: batches cut from one parse


def test_treebank_select_equals_concat_of_the_trees_parsed_one_by_one(rng):
    lines = sst_path("dev").read_text(encoding="utf-8").splitlines()[:120]
    from cortexc.train import Treebank

    bank = Treebank(Forest.from_ptb(lines))
    per_tree = [Forest.from_ptb(line) for line in lines]
    assert len(bank) == len(lines)
    assert bank.select([]).num_nodes == 0
    for chosen in ([0], [119], list(rng.choice(120, 25, replace=False)), [5, 5, 3]):
        got = bank.select(chosen)
        expected = Forest.concat([per_tree[i] for i in chosen])
        for name in ("child_ptr", "child_idx", "labels", "level", "level_order", "level_ptr", "roots", "parents"):
            assert np.array_equal(getattr(got, name), getattr(expected, name)), (chosen, name)
        assert got.words == expected.words
    seen = sorted(int(t) for forest in bank.batches(25, np.random.default_rng(0)) for t in [forest.num_trees])
    assert sum(seen) == 120 and max(seen) == 25


def test_treebank_rejects_what_it_cannot_cut():
    from cortexc.errors import ForestError
    from cortexc.train import Treebank

    with pytest.raises(ForestError, match="two parents"):
        Treebank(Forest.random_dag(10, rng=0))
    with pytest.raises(ForestError, match="node 2 is not a root"):
        Treebank(Forest.from_parents([-1, 0, 0]))  # the root first: not the end of its range
    # node 1's parent is node 3 of the next range (roots 2 and 4)
    with pytest.raises(ForestError, match="different trees' node ranges"):
        Treebank(Forest.from_parents([2, 3, -1, 4, -1]))
    bank = Treebank(Forest.from_ptb("(1 a)\n(2 b)\n"))
    with pytest.raises(ForestError, match="tree 2 is outside 0..1"):
        bank.select([0, 2])


@pytest.mark.slow
def test_the_train_sst_example_runs_a_few_steps_into_its_out_directory(tmp_path, monkeypatch):
    """examples/train_sst.py end to end on a small subset: it writes only into --out, and with no --out nothing."""
    import importlib.util

    sst_path("train")
    spec = importlib.util.spec_from_file_location("train_sst_example", EXAMPLES / "train_sst.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    small = ["--limit", "40", "--dev-limit", "20", "--epochs", "2", "--steps", "2", "--hidden", "6", "--embed", "5"]
    out = tmp_path / "run"
    data = ["--train", str(sst_path("train")), "--dev", str(sst_path("dev"))]
    assert example.main([*small, *data, "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl", "params.npz", "vocab.json"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2] and log[1]["train_loss"] < log[0]["train_loss"] + 0.5
    with np.load(out / "params.npz") as saved:
        assert saved["E"].shape == (len(Vocab.from_dict(json.loads((out / "vocab.json").read_text()))), 5)
    (out / "params.npz").unlink()
    assert example.main([*small, *data]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not (out / "params.npz").exists()


# ----------------------------------------------------------------------------- the sparse step in place


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch.optim's own sparse path
def test_sparse_adagrad_steps_write_no_table_copy_and_match_torch(rng):
    """model.load_params(opt.step(model.params, sparse_grads)) over several steps: the same values as
    torch.optim.Adagrad on sparse COO gradients, one table copy in all (the first step), the model's table
    alternating between two buffers; a table the caller still holds is never written (a copy then)."""
    import torch

    from cortexc.train import SparseRows

    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", X=4, H=3, V=50, C=2)
    model = module.BinaryTreeLSTM(device="cpu", seed=0)
    table = torch.nn.Parameter(torch.from_numpy(model.params["E"].copy()))
    reference = torch.optim.Adagrad([table], lr=0.1)
    opt = Adagrad(lr=0.1)
    buffers = set()

    def step() -> None:
        rows = np.unique(rng.integers(0, 50, 7)).astype(np.int64)
        values = rng.standard_normal((rows.size, 4)).astype(np.float32)
        model.load_params(opt.step(model.params, {"E": SparseRows(rows, values, (50, 4))}))
        buffers.add(id(model.params["E"]))
        index, rows_values = torch.from_numpy(rows)[None], torch.from_numpy(values)
        table.grad = torch.sparse_coo_tensor(index, rows_values, (50, 4), check_invariants=True)
        reference.step()

    for _ in range(6):
        step()
    assert opt.table_copies == 1 and len(buffers) == 2
    assert relative_error(model.params["E"], table.detach().numpy()) < 1e-6
    assert not model.params["E"].flags.writeable

    held = model.params["E"]  # the caller keeps this one: no later step may write it
    snapshot = held.copy()
    for _ in range(3):
        step()
    assert np.array_equal(held, snapshot)
    assert opt.table_copies == 2  # the step that would have reused `held` copied instead
    assert relative_error(model.params["E"], table.detach().numpy()) < 1e-6
