"""Folded look-up projections (`cortexc.passes.fold`) in `cortexc.torch.CellModule` inferences.

A CPU forward after which no backward can follow (grad disabled, or no param or float input requiring
grad) may read rows of the folded table `E @ W^T` instead of running the leaves' GEMM: the results are
bitwise those of the GEMM. The tables are rebuilt after every kind of param change torch records (an
optimizer step, `load_state_dict`, an in-place write under `no_grad`, `.to()`, a replaced param), built
only by inferences (a training forward never pays for one), and switched off by `fold=False`.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cortexc  # noqa: E402
from cortexc import Forest, Vocab  # noqa: E402
from cortexc.targets.c import executor as cpu  # noqa: E402
from cortexc.torch import CellModule, ForestBatch, cell_forward, cell_key  # noqa: E402
from cortexc.torch.runner import runner_for  # noqa: E402
from tests.helpers import EXAMPLES, sst_path  # noqa: E402

V = 60


@pytest.fixture(scope="module")
def binary():
    return cortexc.load(EXAMPLES / "binary_treelstm.cell", V=V, X=8, H=6, C=3).BinaryTreeLSTM


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    """Tables built on the first inference after a change (the default's counting has its own test)."""
    monkeypatch.setenv(cpu.FOLD_VARIABLE, "eager")


def _pair(cls, rng, sparse=False):
    """A folding module and a non-folding one with the same (noisy) params, both in eval mode."""
    folded = CellModule(cls, seed=2, sparse=sparse)
    with torch.no_grad():
        for p in folded.parameters():
            p.add_(torch.from_numpy(0.3 * rng.standard_normal(p.shape).astype(np.float32)))
    plain = CellModule(cls, seed=2, sparse=sparse, fold=False)
    plain.load_state_dict(folded.state_dict())
    return folded.eval(), plain.eval()


def _case(rng, trees=6):
    forest = Forest.random(trees, rng=rng, binary=True, max_children=2, max_nodes=25)
    return forest, torch.as_tensor(rng.integers(0, V, forest.num_nodes))


def _assert_same_bits(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name].detach().numpy(), b[name].detach().numpy()
        assert x.tobytes() == y.tobytes(), f"{name} differs (max {np.abs(x - y).max()})"


def _infer(module, forest, word):
    with torch.no_grad():
        return module(forest, word=word)


def _builds(module):
    return module.runner.executor.fold_builds


def _same_as_unfolded(module, forest, word):
    """The module's folded inference against its own GEMMs on its current params (`fold` off for one call):
    a table left from older params makes them differ."""
    folded = _infer(module, forest, word)
    module.fold = False
    try:
        _assert_same_bits(folded, _infer(module, forest, word))
    finally:
        module.fold = True


@pytest.mark.slow
def test_folded_inference_is_bitwise_the_unfolded_one(binary, rng):
    folded, plain = _pair(binary, rng)
    for _ in range(3):
        forest, word = _case(rng)
        _assert_same_bits(_infer(folded, forest, word), _infer(plain, forest, word))
    with torch.inference_mode():
        _assert_same_bits(folded(forest, word=word), plain(forest, word=word))
    for p in folded.parameters():  # grad enabled, but nothing requires grad: no backward can follow either
        p.requires_grad_(False)
    _assert_same_bits(folded(forest, word=word), _infer(plain, forest, word))
    assert _builds(folded) == 1, "one table per params"
    assert _builds(plain) == 0


def test_the_tables_are_read(binary, rng):
    """Poisoned tables (paired with the current weights) change an inference: the comparisons above and
    below would see a stale table."""
    folded, plain = _pair(binary, rng)
    forest, word = _case(rng)
    _infer(folded, forest, word)
    executor = folded.runner.executor
    weights, tables, seen = executor._folded
    executor._folded = (weights, [np.full_like(t, 7.0) for t in tables], seen)
    assert not torch.equal(_infer(folded, forest, word)["h"], _infer(plain, forest, word)["h"])


def test_a_forward_kept_for_a_backward_never_builds_a_table(binary, rng):
    folded, plain = _pair(binary, rng)
    forest, word = _case(rng)
    for module in (folded, plain):
        module.train()  # binary_treelstm has no dropout: training mode changes nothing but autograd's record
    out = folded(forest, word=word)
    expected = plain(forest, word=word)
    _assert_same_bits(out, expected)
    out["logits"].sum().backward()
    expected["logits"].sum().backward()
    for (name, p), q in zip(folded.named_parameters(), plain.parameters()):
        assert p.grad.numpy().tobytes() == q.grad.numpy().tobytes(), name
    assert _builds(folded) == 0
    _infer(folded, forest, word)
    assert _builds(folded) == 1
    folded(forest, word=word)["logits"].sum().backward()  # a table built already is not read either: unchanged
    assert _builds(folded) == 1


@pytest.mark.parametrize("sparse", [False, True])
def test_tables_follow_optimizer_steps(binary, rng, sparse):
    folded, plain = _pair(binary, rng, sparse=sparse)
    forest, word = _case(rng)
    labels = torch.as_tensor(rng.integers(0, 3, forest.num_nodes))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (folded, plain)]
    for step in range(3):
        for module, optimizer in zip((folded, plain), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(module.train()(forest, word=word)["logits"], labels)
            loss.backward()
            optimizer.step()
            module.eval()
        _assert_same_bits(_infer(folded, forest, word), _infer(plain, forest, word))
        assert _builds(folded) == step + 1
    if sparse:
        assert folded.E.grad.is_sparse  # the step wrote only the looked-up rows of E, in place


def test_tables_follow_every_kind_of_param_change(binary, rng):
    module, _ = _pair(binary, rng)
    forest, word = _case(rng)
    _same_as_unfolded(module, forest, word)
    builds = _builds(module)

    def changed(kind):
        nonlocal builds
        _same_as_unfolded(module, forest, word)
        assert _builds(module) == builds + 1, f"{kind}: the table was not built again"
        builds += 1

    def noise(p):
        return torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32))

    with torch.no_grad():
        module.E.copy_(noise(module.E))
    changed("E written under no_grad")
    with torch.no_grad():
        module.W_iou.mul_(1.5)
    changed("W_iou (the projection) written under no_grad")
    module.E.detach().add_(1.0)
    changed("E written through detach()")
    state = {k: v + 0.5 * noise(v) for k, v in module.state_dict().items()}
    module.load_state_dict(state)
    changed("load_state_dict")
    module.load_state_dict({k: v * 0.5 for k, v in state.items()}, assign=True)
    changed("load_state_dict(assign=True)")
    module.double().float()
    changed(".double().float()")
    module.to(torch.float64).to(torch.float32)
    changed(".to(float64).to(float32)")
    module.E = torch.nn.Parameter(noise(module.E))
    changed("a new E")
    # torch does not record writes through .data (no version counter moves): params_changed says so
    version = module.E._version
    module.E.data.copy_(noise(module.E))
    assert module.E._version == version
    module.params_changed()
    changed("E.data.copy_ and params_changed()")
    with torch.no_grad():
        module.b_iou.add_(1.0)  # neither the table nor a packed weight: the table stays
    _same_as_unfolded(module, forest, word)
    module.b_iou = torch.nn.Parameter(noise(module.b_iou))  # replaced: read from the new tensor
    _same_as_unfolded(module, forest, word)
    assert _builds(module) == builds
    with torch.no_grad():
        module.W_s.mul_(2.0)  # a packed weight no fold reads: packed again, and (so) the table built again
    changed("W_s")


def test_the_fold_switch_and_the_environment(binary, rng, monkeypatch):
    forest, word = _case(rng)
    module = CellModule(binary, fold=False).eval()
    assert "fold=False" in repr(module)
    for twin in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert twin.fold is False
        _infer(twin, forest, word)
        assert _builds(twin) == 0
    _infer(module, forest, word)
    assert _builds(module) == 0
    module.fold = True
    _infer(module, forest, word)
    assert _builds(module) == 1
    assert copy.deepcopy(module).fold is True
    state = module.__getstate__()
    del state["fold"]  # a module pickled before the switch existed folds
    old = CellModule.__new__(CellModule)
    old.__setstate__(state)
    assert old.fold is True

    monkeypatch.setenv(cpu.FOLD_VARIABLE, "0")
    fresh = CellModule(binary).eval()
    _infer(fresh, forest, word)
    assert _builds(fresh) == 0
    monkeypatch.setenv(cpu.FOLD_VARIABLE, "eager")
    monkeypatch.setenv(cpu.FOLD_LIMIT_VARIABLE, "0")
    _infer(fresh, forest, word)
    assert fresh.runner.executor._folded[1] == [None]  # the cap leaves no table: the GEMM runs


def test_by_default_a_table_is_built_once_inferences_ran_its_rows(binary, rng, monkeypatch):
    """Unset CORTEXC_FOLD: inferences since the params changed count their nodes until they reach the
    table's V rows; training forwards do not count; a change starts the count again."""
    monkeypatch.delenv(cpu.FOLD_VARIABLE)
    folded, plain = _pair(binary, rng)
    forest, word = _case(rng, trees=2)
    calls_to_pay = -(-V // forest.num_nodes)
    assert calls_to_pay > 1
    for _ in range(2):
        for call in range(calls_to_pay):
            folded(forest, word=word)  # grad enabled, params require grad: kept for a backward
            _assert_same_bits(_infer(folded, forest, word), _infer(plain, forest, word))
            assert (folded.runner.executor._folded[1] is not None) == (call == calls_to_pay - 1)
        with torch.no_grad():
            folded.b_iou.add_(0.0)  # a change (the version counter moves) of a param no fold reads...
            folded.E.add_(0.0)  # ...and of the table: counted again
    assert _builds(folded) == 2


@pytest.mark.slow
def test_opcheck_and_compile_with_fold(binary, rng):
    from torch._dynamo.utils import counters

    module, plain = _pair(binary, rng)
    forest, word = _case(rng)
    batch = ForestBatch.from_forest(forest)
    params = [getattr(module, n).detach().clone() for n in module.runner.params]
    key = cell_key(binary, "cpu")
    args = (key, params, [word.to(torch.int32)], *batch.tensors(), False, torch.zeros((), dtype=torch.int64))
    torch.library.opcheck(cell_forward, (*args, True))
    shared = runner_for(key, params, None)  # opcheck's copies belong to no module: the key's shared runner
    assert shared is not module.runner and shared.executor.fold_builds >= 1  # the op itself folds with fold=True
    builds = _builds(module)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        forest, word = _case(rng)
        batch = ForestBatch.from_forest(forest)
        _assert_same_bits(_infer(compiled, batch, word), _infer(plain, batch, word))
    assert _builds(module) == builds + 1, "the compiled graph folds (new params: the module's own, not opcheck's)"
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
def test_sst_dev_trees_fold_bitwise_through_the_module(rng):
    """The SST binary Tree-LSTM at its own size (V=21701, X=300, H=150) on the whole dev set."""
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    forest = Forest.from_ptb(lines)
    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell").BinaryTreeLSTM
    ids = Vocab.build([forest]).encode(forest)
    word = torch.as_tensor(np.where(ids < cls.signature.inputs[0].index_range, ids, 1))
    folded, plain = _pair(cls, rng)
    batch = ForestBatch.from_forest(forest)
    _assert_same_bits(_infer(folded, batch, word), _infer(plain, batch, word))
    assert _builds(folded) == 1


def test_the_sparse_tables_broadcast_rebuilds_the_table(binary, rng, monkeypatch):
    """`dist.broadcast` (rank 0's sparse tables, on the first forward with grad under several ranks) writes
    in place without moving the version counter (seen on 2 gloo ranks): the module says the params changed.
    Stood in for here by a broadcast that writes through `.data`, in a pretend group of 2 ranks."""
    import torch.distributed as dist

    import cortexc.torch.ddp as cortexc_ddp

    module, _ = _pair(binary, rng, sparse=True)
    forest, word = _case(rng)
    _same_as_unfolded(module, forest, word)
    rank0 = torch.from_numpy(rng.standard_normal(module.E.shape).astype(np.float32))
    monkeypatch.setattr(cortexc_ddp, "_distributed", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: "group")
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: 0)
    monkeypatch.setattr(dist, "broadcast", lambda table, src, group: table.data.copy_(rank0))
    module.train()(forest, word=word)  # grad enabled: the broadcast
    assert torch.equal(module.E.detach(), rank0)
    _same_as_unfolded(module.eval(), forest, word)
    assert _builds(module) == 2
