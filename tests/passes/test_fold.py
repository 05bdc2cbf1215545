"""Folded look-up projections (`cortexc.passes.fold`): an inference reads rows of `E @ W^T`, built by the
package's `cx_fold`, instead of running the GEMM of `W @ E[word]`.

Folded and unfolded forwards must give identical bits (the table is the kernels' own GEMM); the table is
rebuilt after every param change (`load_params`, an optimizer step), never read by a forward kept for a
backward, capped in memory and switched off by `fold=False` or `CORTEXC_FOLD=0`.
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest, Vocab
from cortexc.targets.c import executor as cpu
from cortexc.train import SGD, Adagrad, softmax_cross_entropy
from tests.helpers import EXAMPLES, relative_error, sst_path, word_child_sum

WORD_CHILD_SUM = word_child_sum(300, 24, 16)

_MODULES: dict[str, object] = {}


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    """The tables built on the first inference (the default waits until they pay: its own test below)."""
    monkeypatch.setenv(cpu.FOLD_VARIABLE, "eager")


def _binary():
    if "binary" not in _MODULES:
        _MODULES["binary"] = cortexc.load(EXAMPLES / "binary_treelstm.cell", V=500, X=40, H=24)
    return _MODULES["binary"].BinaryTreeLSTM


def _child_sum(tmp_path_factory):
    if "child_sum" not in _MODULES:
        path = tmp_path_factory.mktemp("fold") / "word_child_sum.cell"
        path.write_text(WORD_CHILD_SUM, encoding="utf-8")
        _MODULES["child_sum"] = cortexc.load(path)
    return _MODULES["child_sum"].WordChildSum


@pytest.fixture(params=["binary", "child_sum"])
def cell_class(request, tmp_path_factory):
    return _binary() if request.param == "binary" else _child_sum(tmp_path_factory)


def _jittered(cls, rng, seed=3):
    """A folding and a non-folding model with the same (noisy) params, and those params."""
    folded, plain = cls(seed=seed), cls(seed=seed, fold=False)
    params = {k: v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in folded.params.items()}
    folded.load_params(params)
    plain.load_params(params)
    return folded, plain, params


def _forest(cls, rng, trees=12):
    binary = cls.signature.arity == 2
    forest = Forest.random(trees, rng=rng, binary=binary, max_children=2 if binary else 4, max_nodes=40)
    vocab = cls.signature.inputs[0].index_range
    return forest, rng.integers(0, vocab, forest.num_nodes).astype(np.int32)


def _assert_same_bits(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), f"{name} differs (max {np.abs(a[name] - b[name]).max()})"


def test_folded_forward_is_bitwise_the_unfolded_one(cell_class, rng):
    folded, plain, _ = _jittered(cell_class, rng)
    for _ in range(3):
        forest, words = _forest(cell_class, rng)
        _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
    executor = folded._executor
    assert executor.fold_builds == 1, "the tables are built once per params"
    assert len(cell_class._spec.target("c").folds) == (1 if cell_class.__name__ == "BinaryTreeLSTM" else 2)
    assert plain._executor.fold_builds == 0


def test_folded_forward_matches_the_interpreter(cell_class, rng):
    folded, _, params = _jittered(cell_class, rng)
    reference = cell_class(device="interp")
    reference.load_params(params)
    forest, words = _forest(cell_class, rng)
    out, expected = folded(forest, word=words), reference(forest, word=words)
    assert folded._executor.fold_builds == 1
    for name in expected:
        assert relative_error(out[name], expected[name]) <= 1e-5, name


def test_the_kernels_read_the_tables_in_inference_only(rng):
    """Poisoned tables (paired with the current weights) change an inference, never a grad=True forward."""
    cls = _binary()
    folded, plain, _ = _jittered(cls, rng)
    forest, words = _forest(cls, rng)
    folded(forest, word=words)
    executor = folded._executor
    weights, tables, seen = executor._folded
    executor._folded = (weights, [np.full_like(t, 7.0) for t in tables], seen)
    poisoned = folded(forest, word=words)
    assert not np.array_equal(poisoned["h"], plain(forest, word=words)["h"]), "the tables were not read"
    trained = folded(forest, grad=True, word=words)
    plain_trained = plain(forest, grad=True, word=words)
    _assert_same_bits({k: trained[k] for k in ("h", "c", "logits")}, plain_trained)
    grads = folded.backward(trained, {"logits": np.ones_like(trained["logits"])})
    expected = plain.backward(plain_trained, {"logits": np.ones_like(trained["logits"])})
    _assert_same_bits(grads, expected)


def test_tables_follow_load_params(cell_class, rng):
    folded, plain, params = _jittered(cell_class, rng)
    forest, words = _forest(cell_class, rng)
    _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
    for name in ("E", "W_iou"):  # the table itself, then a projection
        changed = {name: params[name] + rng.standard_normal(params[name].shape).astype(np.float32)}
        folded.load_params(changed)
        plain.load_params(changed)
        _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
    assert folded._executor.fold_builds == 3


@pytest.mark.parametrize("optimizer", [lambda: SGD(0.5), lambda: Adagrad(0.5)])
@pytest.mark.parametrize("sparse", [False, True])
def test_tables_follow_training_steps(optimizer, sparse, rng):
    """Steps of `cortexc.train` (dense, and sparse ones that write a table buffer in place) between inferences."""
    cls = _binary()
    folded, plain, _ = _jittered(cls, rng)
    opt_folded, opt_plain = optimizer(), optimizer()
    forest, words = _forest(cls, rng)
    labels = rng.integers(0, 5, forest.num_nodes)
    for _ in range(4):
        for model, opt in ((folded, opt_folded), (plain, opt_plain)):
            out = model(forest, grad=True, word=words)
            _, d_logits = softmax_cross_entropy(out["logits"], labels)
            grads = model.backward(out, {"logits": d_logits}, sparse=sparse)
            model.load_params(opt.step(model.params, grads))
        _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
    assert folded._executor.fold_builds == 4
    if sparse:  # the sparse steps still reuse the table buffers: the cache holds no old table
        assert opt_folded.table_copies == opt_plain.table_copies


def test_off_switches_and_the_memory_cap(monkeypatch, tmp_path_factory, rng):
    cls = _child_sum(tmp_path_factory)
    folded, plain, _ = _jittered(cls, rng)
    forest, words = _forest(cls, rng)
    folded(forest, word=words)  # builds the executor
    executor = folded._executor
    sizes = [f.rows * f.m * 4 for f in cls._spec.target("c").folds]
    tables = executor.folded_tables(executor._weights)
    assert tables is not None and [t.nbytes for t in tables] == sizes

    monkeypatch.setenv(cpu.FOLD_VARIABLE, "0")
    assert executor.folded_tables(executor._weights) is None
    monkeypatch.setenv(cpu.FOLD_VARIABLE, "eager")
    folded.fold = False
    assert executor.folded_tables(executor._weights) is None
    folded.fold = True

    # a cap that leaves room for the first table only: the second stays a GEMM (and results the same bits)
    monkeypatch.setenv(cpu.FOLD_LIMIT_VARIABLE, str((sizes[0] + sizes[1] // 2) / 2**20))
    folded.load_params({"b_f": folded.params["b_f"]})  # new weights: the tables are built again
    tables = executor.folded_tables(executor._weights)
    assert tables is not None and tables[0] is not None and tables[1] is None
    _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
    monkeypatch.setenv(cpu.FOLD_LIMIT_VARIABLE, "0")
    folded.load_params({"b_f": folded.params["b_f"]})
    assert executor.folded_tables(executor._weights) is None
    assert cpu.fold_limit_bytes() == 0
    monkeypatch.setenv(cpu.FOLD_LIMIT_VARIABLE, "lots")
    assert cpu.fold_limit_bytes() == cpu.FOLD_LIMIT_MB * 2**20


def test_kernel_text_folded_branch_has_no_gemm(tmp_path_factory):
    """The C leaf and pre kernels: in the folded branch a row copy, the GEMM only in the other; gradient
    kernels and the CUDA source never read a table."""
    cls = _child_sum(tmp_path_factory)
    c_source, cuda_source = cls._kernel_sources["c"], cls._kernel_sources.get("cuda", "")
    for kernel in ("pre", "leaf"):
        body = c_source.split(f"static void cx_kernel_{kernel}(")[1].split("\n}\n")[0]
        folded, rest = body.split("if (call->folded && call->folded[")[1].split("} else {", 1)
        assert "memcpy" in folded and "cx_gemm" not in folded
        assert any(gemm in rest.split("\n    }\n")[0] for gemm in ("cx_gemm_rows_all(", "cx_gemm_split("))
    for kernel in ("grad_leaf", "grad_pre", "node"):
        body = c_source.split(f"static void cx_kernel_{kernel}(")[1].split("\n}\n")[0]
        assert "folded" not in body
    assert "int cx_fold(" in c_source
    assert "call->folded[" not in cuda_source


@pytest.mark.slow
def test_sst_dev_trees_fold_bitwise(rng):
    """The SST binary Tree-LSTM at its own size (V=21701, X=300, H=150) on the whole dev set."""
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    forest = Forest.from_ptb(lines)
    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell").BinaryTreeLSTM
    ids = Vocab.build([forest]).encode(forest)
    words = np.where(ids < cls.signature.inputs[0].index_range, ids, 1).astype(np.int32)
    folded, plain, _ = _jittered(cls, rng)
    _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
    assert folded._executor.fold_builds == 1


def test_by_default_tables_are_built_once_they_pay(monkeypatch, rng):
    """Unset CORTEXC_FOLD: the inferences since the params changed run the GEMMs until they have run as many
    rows as the table has (V = 500 here); grad=True forwards do not count; a param change starts again."""
    monkeypatch.delenv(cpu.FOLD_VARIABLE)
    cls = _binary()
    folded, plain, _ = _jittered(cls, rng)
    forest, words = _forest(cls, rng)
    calls_to_pay = -(-500 // forest.num_nodes)
    for _ in range(2):
        for call in range(calls_to_pay):
            folded(forest, grad=True, word=words)
            _assert_same_bits(folded(forest, word=words), plain(forest, word=words))
            assert (folded._executor._folded[1] is not None) == (call == calls_to_pay - 1)
        folded.load_params({"b_iou": folded.params["b_iou"]})
    assert folded._executor.fold_builds == 2
