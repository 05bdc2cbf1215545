"""cortexc.torch: a compiled cell as an nn.Module (../shared/spec/torch.md).

Numbers against the interpreter and against per-node PyTorch models written here independently
(tests/ir/test_autodiff.py); the custom ops through `torch.library.opcheck`; `torch.compile` with a
recompile count; pickling; sparse embedding gradients; typed errors.
"""

from __future__ import annotations

import copy
import ctypes
import pickle
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cortexc  # noqa: E402
from cortexc import Forest, InputError  # noqa: E402
from cortexc.errors import CortexcError  # noqa: E402
from cortexc.torch import CellModule, ForestBatch, _split, cell_backward, cell_forward, cell_key  # noqa: E402
from tests.helpers import EXAMPLES, REPO, relative_error  # noqa: E402
from tests.ir.test_autodiff import torch_binary_treelstm, torch_childsum  # noqa: E402

BINARY = {"V": 40, "X": 6, "H": 5, "C": 3}
CHILDSUM = {"X": 6, "H": 5}


@pytest.fixture(scope="module")
def binary():
    return cortexc.load(EXAMPLES / "binary_treelstm.cell", **BINARY).BinaryTreeLSTM


@pytest.fixture(scope="module")
def childsum():
    return cortexc.load(EXAMPLES / "treelstm.cell", **CHILDSUM).ChildSumTreeLSTM


def jittered(cls, rng, seed=0):
    """A module and an interpreter model with the same params: the seeded init plus noise."""
    module = CellModule(cls, seed=seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.from_numpy(0.3 * rng.standard_normal(p.shape).astype(np.float32)))
    reference = cls(device="interp", seed=seed)
    reference.load_params({k: v.detach().numpy() for k, v in module.state_dict().items()})
    return module, reference


def binary_case(rng, trees=4, max_nodes=11):
    forest = Forest.random(trees, rng=rng, binary=True, max_children=2, max_nodes=max_nodes)
    word = rng.integers(0, BINARY["V"], forest.num_nodes)
    return forest, word


def test_params_are_named_and_initialised_as_the_cell_declares(binary, tmp_path):
    module = CellModule(binary, seed=3)
    names = [p.name for p in binary.signature.params]
    assert [n for n, _ in module.named_parameters()] == names
    assert list(module.state_dict()) == names
    model = binary(device="cpu", seed=3)
    for name, value in model.params.items():
        param = getattr(module, name)
        assert isinstance(param, torch.nn.Parameter) and param.dtype == torch.float32
        assert np.array_equal(param.detach().numpy(), value)
    # state_dict keys are the .npz keys of the NumPy API
    model.save_params(tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as archive:
        module.load_state_dict({k: torch.from_numpy(archive[k]) for k in archive.files})


def test_forward_and_gradients_match_the_interpreter(binary, rng):
    module, reference = jittered(binary, rng)
    forest, word = binary_case(rng)
    out = module(ForestBatch.from_forest(forest), word=torch.as_tensor(word))
    expected = reference(forest, grad=True, word=word)
    for name, value in expected.items():
        assert relative_error(out[name].detach().numpy(), value) < 1e-5, name
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
    loss = sum((out[k] * torch.from_numpy(g)).sum() for k, g in upstream.items())
    loss.backward()
    grads = reference.backward(expected, upstream)
    for name, value in grads.items():
        assert relative_error(getattr(module, name).grad.numpy(), value) < 1e-5, name


def test_gradients_match_per_node_torch_for_any_subset_of_results(binary, rng):
    """A loss of the root logits only, then of h only: every param's gradient as the per-node model's."""
    module, _ = jittered(binary, rng)
    forest, word = binary_case(rng, trees=3)
    children = _children(forest)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in module.state_dict().items()}
    labels = torch.as_tensor(rng.integers(0, BINARY["C"], len(forest.roots)))
    roots = torch.tensor(forest.roots)
    for result in ("logits", "h"):
        module.zero_grad()
        for p in params.values():
            p.grad = None
        out = module(forest, word=torch.as_tensor(word))
        mine = _loss(out, result, roots, labels)
        mine.backward()
        theirs = _loss(
            torch_binary_treelstm(children)(torch, params, {"word": torch.as_tensor(word)}), result, roots, labels
        )
        theirs.backward()
        assert abs(mine.item() - theirs.item()) < 1e-5 * max(1.0, abs(theirs.item()))
        for name, p in params.items():
            got = getattr(module, name).grad
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            assert relative_error(got.numpy(), expected.numpy()) < 1e-4, (result, name)


def _children(forest):
    """Each node's children in the forest's own order (child 0 first), from its CSR arrays."""
    ptr, idx = forest.child_ptr, forest.child_idx
    return [[int(c) for c in idx[ptr[n] : ptr[n + 1]]] for n in range(forest.num_nodes)]


def _loss(out, result, roots, labels):
    if result == "logits":
        return torch.nn.functional.cross_entropy(out["logits"][roots], labels)
    return (out["h"] ** 2).sum()


@pytest.mark.slow
def test_float_input_gradients_against_per_node_torch(childsum, rng):
    module, reference = jittered(childsum, rng)
    forest = Forest.random(3, rng=rng, max_children=4, max_nodes=10)
    x_np = rng.standard_normal((forest.num_nodes, CHILDSUM["X"])).astype(np.float32)
    x = torch.tensor(x_np, requires_grad=True)
    out = module(forest, x=x)
    weight = torch.from_numpy(rng.standard_normal(out["c"].shape).astype(np.float32))
    (out["c"] * weight).sum().backward()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in module.state_dict().items()}
    x_ref = torch.tensor(x_np, requires_grad=True)
    theirs = torch_childsum(_children(forest))(torch, params, {"x": x_ref})
    (theirs["c"] * weight).sum().backward()
    assert relative_error(x.grad.numpy(), x_ref.grad.numpy()) < 1e-4
    for name, p in params.items():
        assert relative_error(getattr(module, name).grad.numpy(), p.grad.numpy()) < 1e-4, name
    # and the interpreter agrees on the input gradient
    expected = reference(forest, grad=True, x=x_np)
    grads = reference.backward(expected, {"c": weight.numpy()})
    assert relative_error(x.grad.numpy(), grads["x"]) < 1e-5


def test_results_the_loss_does_not_use_get_no_upstream(binary, rng, monkeypatch):
    module = CellModule(binary)
    forest, word = binary_case(rng)
    seen = []
    executor = module.runner.executor
    original = executor.run_backward

    def spy(lin, params, inputs, states, hoisted, grads, **options):
        seen.append([g is None for g in grads[4]])
        return original(lin, params, inputs, states, hoisted, grads, **options)

    monkeypatch.setattr(executor, "run_backward", spy)
    out = module(forest, word=torch.as_tensor(word))
    out["h"].sum().backward()
    assert seen == [[True]]  # the logits' phases get no upstream
    module.zero_grad()
    out = module(forest, word=torch.as_tensor(word))
    (out["h"] * 0).sum().backward()  # used: an upstream of zeros, still the phases
    assert module.W_s.grad is not None and float(module.W_s.grad.abs().sum()) == 0.0


def test_inputs_and_results_share_memory_with_the_kernels(childsum, rng, monkeypatch):
    module = CellModule(childsum)
    forest = Forest.random(2, rng=rng, max_nodes=8)
    x = torch.from_numpy(rng.standard_normal((forest.num_nodes, CHILDSUM["X"])).astype(np.float32))
    seen = {}
    executor = module.runner.executor
    original = executor.run_forward

    def spy(lin, params, inputs, states, hoisted, outputs, **options):
        seen["input"] = inputs[0].ctypes.data
        seen["state"] = states[0].ctypes.data
        seen["param"] = params[0].ctypes.data
        return original(lin, params, inputs, states, hoisted, outputs, **options)

    monkeypatch.setattr(executor, "run_forward", spy)
    out = module(forest, x=x)
    assert seen["input"] == x.data_ptr()
    assert seen["state"] == out[module.runner.states[0]].data_ptr()
    assert seen["param"] == getattr(module, module.runner.params[0]).data_ptr()


def test_weights_are_packed_again_only_when_a_param_changed(binary, rng):
    module = CellModule(binary)
    forest, word = binary_case(rng)
    word = torch.as_tensor(word)
    runner = module.runner
    module(forest, word=word)
    module(forest, word=word)
    assert runner.repacks == 1
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(forest, word=word)["h"].sum().backward()
    optimizer.step()
    first = module(forest, word=word)
    assert runner.repacks == 2
    # the packed weights follow the new params: the result is the NumPy model's with these params
    model = binary(device="cpu")
    model.load_params({k: v.detach().numpy() for k, v in module.state_dict().items()})
    assert relative_error(first["h"].detach().numpy(), model(forest, word=word.numpy())["h"]) < 1e-6
    with torch.no_grad():
        module.U_iou.mul_(0.5)
    after = module(forest, word=word)
    model.load_params({"U_iou": module.U_iou.detach().numpy()})
    assert runner.repacks == 3
    assert relative_error(after["h"].detach().numpy(), model(forest, word=word.numpy())["h"]) < 1e-6


def test_opcheck_passes_on_both_ops(binary, rng):
    module = CellModule(binary)
    forest, word = binary_case(rng)
    batch = ForestBatch.from_forest(forest)
    params = [getattr(module, n).detach().clone().requires_grad_(True) for n in module.runner.params]
    inputs = [torch.as_tensor(word, dtype=torch.int32)]
    key = cell_key(binary, "cpu")
    args = (key, params, inputs, *batch.tensors(), False, torch.zeros((), dtype=torch.int64))
    torch.library.opcheck(cell_forward, args)
    results = cell_forward(*args)
    states, hoisted, activations, _ = ([r.detach() for r in group] for group in _split(module.runner, results))
    assert activations and all(a.shape[0] > 0 for a in activations)  # a CPU runner saves activations
    d_states = [torch.randn(states[0].shape), None]
    d_outputs = [torch.randn(results[-1].shape)]  # the backward is not differentiable itself
    detached = [p.detach() for p in params]
    torch.library.opcheck(
        cell_backward,
        (
            key,
            detached,
            inputs,
            *batch.tensors(),
            states,
            hoisted,
            activations,
            d_states,
            d_outputs,
            *args[-2:],
        ),
    )


def test_torch_compile_fullgraph_does_not_recompile_after_the_second_size(binary, rng):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = CellModule(binary)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    cherry = Forest.from_parents([2, 2, -1])  # two of them: every size (internal nodes, roots, ...) is >= 2,
    for trees in (2, 3, 5, 7):  # so no size is specialised as 0 or 1
        while True:  # sizes that differ from each other: dynamo gives equal sizes one symbol (duck shaping)
            random_part, _ = binary_case(rng, trees=trees)
            forest = Forest.concat([random_part, cherry, cherry])
            sizes = [t.shape[0] for t in ForestBatch.from_forest(forest).tensors() if t is not None]
            if len(set(sizes[:2] + sizes[4:])) == 4:  # nodes, levels + 1, roots, internal (edges = 2 * internal)
                break
        word = rng.integers(0, BINARY["V"], forest.num_nodes)
        out = compiled(ForestBatch.from_forest(forest), word=torch.as_tensor(word))
        expected = module(forest, word=torch.as_tensor(word))
        assert torch.equal(out["logits"], expected["logits"])
        out["logits"].sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
def test_a_cell_module_pickles_and_deep_copies(binary, rng, tmp_path):
    module, _ = jittered(binary, rng)
    forest, word = binary_case(rng)
    word = torch.as_tensor(word)
    expected = module(forest, word=word)["logits"]
    for twin in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert twin.runner is not module.runner
        assert torch.equal(twin(forest, word=word)["logits"], expected)
        with torch.no_grad():
            twin.W_s.zero_()  # its own params
        assert not torch.equal(twin(forest, word=word)["logits"], expected)
    torch.save(module, tmp_path / "m.pt")
    with open(tmp_path / "forest.pickle", "wb") as file:
        pickle.dump((forest, word, expected), file)
    script = (
        "import pickle, sys, torch\n"
        f"m = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
        f"forest, word, expected = pickle.load(open({str(tmp_path / 'forest.pickle')!r}, 'rb'))\n"
        "assert torch.equal(m(forest, word=word)['logits'], expected)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr


def _env():
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_import_cortexc_and_the_numpy_api_never_import_torch(binary, rng):
    """torch is an optional extra: importing cortexc, loading a built package and running a model (forward,
    backward) in a fresh process leave torch unimported."""
    script = (
        "import sys, numpy as np, cortexc\n"
        "from cortexc.runtime.model import cell_class\n"
        f"model = cell_class({str(binary._package)!r}, 'BinaryTreeLSTM')(device='cpu', seed=0)\n"
        "forest = cortexc.Forest.from_parents([2, 2, -1])\n"
        "out = model(forest, grad=True, word=np.array([1, 2, 0]))\n"
        "model.backward(out, {'logits': np.ones_like(out['logits'])})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr


def test_a_numpy_model_pickles_and_deep_copies(binary, rng):
    model = binary(device="cpu", seed=1)
    model.load_params({"W_s": rng.standard_normal(model.params["W_s"].shape).astype(np.float32)})
    forest, word = binary_case(rng)
    expected = model(forest, word=word)["logits"]
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(twin).signature == binary.signature and twin.device == "cpu"
        assert np.array_equal(twin(forest, word=word)["logits"], expected)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's Adagrad, not us
def test_sparse_embedding_gradient_holds_the_looked_up_rows(binary, rng):
    dense, _ = jittered(binary, rng)
    sparse = CellModule(binary, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    forest, word = binary_case(rng)
    word = torch.as_tensor(word)
    for module in (dense, sparse):
        out = module(forest, word=word)
        torch.nn.functional.cross_entropy(out["logits"], torch.zeros(forest.num_nodes, dtype=torch.long)).backward()
        assert (
            relative_error(out["logits"].detach().numpy(), dense(forest, word=word)["logits"].detach().numpy()) < 1e-6
        )
    grad = sparse.E.grad
    assert grad.is_sparse
    grad = grad.coalesce()
    leaves = np.flatnonzero(forest.num_children == 0)
    assert sorted(grad.indices()[0].tolist()) == sorted(set(word.numpy()[leaves].tolist()))
    assert relative_error(grad.to_dense().numpy(), dense.E.grad.numpy()) < 1e-6
    for name in ("W_iou", "U_iou", "W_s"):
        assert relative_error(getattr(sparse, name).grad.numpy(), getattr(dense, name).grad.numpy()) < 1e-6
    torch.optim.Adagrad([sparse.E], lr=0.1).step()  # the optimizers that take sparse gradients


def test_bad_forests_and_inputs_give_typed_errors(binary, rng):
    module = CellModule(binary)
    forest, word = binary_case(rng)
    with pytest.raises(InputError, match="shape"):
        module(forest, word=torch.as_tensor(word[:-1]))
    bad = word.copy()
    bad[0] = BINARY["V"]
    with pytest.raises(InputError, match="outside"):
        module(forest, word=torch.as_tensor(bad))
    with pytest.raises(InputError, match="missing input"):
        module(forest)
    with pytest.raises(InputError, match="integers"):
        module(forest, word=torch.as_tensor(word, dtype=torch.float32))
    wide = Forest.from_parents([-1, 0, 0, 0])
    with pytest.raises(cortexc.ForestError):
        module(wide, word=torch.zeros(4, dtype=torch.long))
    with pytest.raises(InputError, match="has no input 'wrd'"):
        module(forest, word=torch.as_tensor(word), wrd=torch.as_tensor(word))
    with pytest.raises(InputError, match="is on meta"):
        module(forest, word=torch.as_tensor(word).to("meta"))
    with pytest.raises(InputError, match="expected a cortexc.torch.ForestBatch"):
        module([forest], word=torch.as_tensor(word))
    with pytest.raises(InputError, match="expects a cortexc.Forest"):
        ForestBatch.from_forest(np.zeros(3))


def test_a_float_input_of_another_dtype_is_converted_and_integers_refused(childsum, rng):
    module = CellModule(childsum)
    forest = Forest.random(2, rng=rng, max_nodes=8)
    x = rng.standard_normal((forest.num_nodes, CHILDSUM["X"]))
    batch = ForestBatch.from_forest(forest)
    assert batch.roots.dtype == torch.long and batch.roots.tolist() == list(forest.roots)
    as_float32 = module(batch, x=torch.from_numpy(x.astype(np.float32)))
    as_float64 = module(batch, x=torch.from_numpy(x))
    assert as_float64["h"].dtype == torch.float32 and torch.equal(as_float64["h"], as_float32["h"])
    with pytest.raises(InputError, match="must be float32"):
        module(batch, x=torch.zeros((forest.num_nodes, CHILDSUM["X"]), dtype=torch.int64))
    with pytest.raises(InputError, match="must have shape"):
        module(batch, x=torch.zeros((forest.num_nodes, CHILDSUM["X"] + 1)))


def test_a_compiled_module_still_gives_typed_errors_for_bad_indices_and_forests(binary, rng):
    """A compiled graph skips `CellModule._check`; the op itself refuses an index out of its table's range
    (also one that int32 would wrap into range), a node with too many children and a shared child."""
    torch._dynamo.reset()
    module = CellModule(binary)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    forest, word = binary_case(rng)
    assert torch.equal(
        compiled(ForestBatch.from_forest(forest), word=torch.as_tensor(word))["logits"],
        module(forest, word=torch.as_tensor(word))["logits"],
    )
    for bad_value in (BINARY["V"], -1, 2**32 + 1):
        bad = torch.as_tensor(word).clone()
        bad[3] = bad_value
        with pytest.raises(InputError, match=f"node 3 has index {bad_value}, outside"):
            compiled(ForestBatch.from_forest(forest), word=bad)
    wide = Forest.concat([forest, Forest.from_parents([3, 3, 3, -1])])
    with pytest.raises(cortexc.ForestError, match="has 3 children but cell BinaryTreeLSTM's arity is 2"):
        compiled(ForestBatch.from_forest(wide), word=torch.zeros(wide.num_nodes, dtype=torch.long))
    shared = Forest(np.array([0, 0, 0, 2, 4]), np.array([0, 1, 0, 1]))  # nodes 2 and 3 both read 0 and 1
    with pytest.raises(cortexc.ForestError, match="parents; cell BinaryTreeLSTM is on a tree"):
        compiled(
            ForestBatch.from_forest(Forest.concat([forest, shared])),
            word=torch.zeros(forest.num_nodes + 4, dtype=torch.long),
        )


def test_the_numpy_api_refuses_a_tensor_that_requires_grad(childsum, rng):
    model = childsum(device="cpu")
    forest = Forest.random(2, rng=rng, max_nodes=6)
    x = torch.zeros((forest.num_nodes, CHILDSUM["X"]), requires_grad=True)
    with pytest.raises(InputError, match="requires grad"):
        model(forest, x=x)
    with pytest.raises(InputError, match="requires grad"):
        model.load_params({"W_iou": torch.zeros(model.params["W_iou"].shape, requires_grad=True)})
    assert model(forest, x=x.detach())["h"].shape == (forest.num_nodes, CHILDSUM["H"])


def test_sparse_adagrad_native_and_torch_agree_with_the_dense_step(binary, rng):
    """Two Adagrad steps: native with SparseRows gradients, native dense, and torch.optim on the sparse
    COO gradient of a CellModule(sparse=True) give the same params; untouched rows stay put."""
    from cortexc.train import Adagrad, SparseRows

    module = CellModule(binary, sparse=True, seed=2)
    sparse_model, dense_model = binary(device="cpu", seed=2), binary(device="cpu", seed=2)
    sparse_opt, dense_opt = Adagrad(lr=0.1), Adagrad(lr=0.1)
    torch_opt = torch.optim.Adagrad(module.parameters(), lr=0.1)
    start = sparse_model.params["E"].copy()
    looked_up = set()
    for _ in range(2):
        forest, word = binary_case(rng)
        looked_up |= set(word[forest.num_children == 0].tolist())
        upstream = rng.standard_normal((forest.num_nodes, BINARY["C"])).astype(np.float32)
        for model, opt, sparse in ((sparse_model, sparse_opt, True), (dense_model, dense_opt, False)):
            out = model(forest, grad=True, word=word)
            grads = model.backward(out, {"logits": upstream}, sparse=sparse)
            assert isinstance(grads["E"], SparseRows) == sparse
            model.load_params(opt.step(model.params, grads))
        torch_opt.zero_grad()
        (module(forest, word=torch.as_tensor(word))["logits"] * torch.from_numpy(upstream)).sum().backward()
        torch_opt.step()
    for name, value in dense_model.params.items():
        assert relative_error(sparse_model.params[name], value) < 1e-6, name
        assert relative_error(getattr(module, name).detach().numpy(), value) < 1e-5, name
    untouched = sorted(set(range(BINARY["V"])) - looked_up)
    assert np.array_equal(sparse_model.params["E"][untouched], start[untouched])
    assert not np.array_equal(sparse_model.params["E"], start)


# ----------------------------------------------------------------------------- the CUDA host path, emulated


def _device_case(cls, rng, sparse: bool = False):
    """A cpu module and one driving the CUDA host path through the emulator, with the same params."""
    on_cpu, emulated = CellModule(cls, seed=4, sparse=sparse), CellModule(cls, seed=4, sparse=sparse)
    with torch.no_grad():
        for p, q in zip(on_cpu.parameters(), emulated.parameters()):
            p.add_(torch.from_numpy(0.3 * rng.standard_normal(p.shape).astype(np.float32)))
            q.copy_(p)
    return on_cpu, emulated.use_backend("cuda-emu")


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_the_cuda_host_path_matches_the_cpu_module(binary, childsum, rng, sparse):
    """What `.to("cuda")` runs — torch-allocated results, params and inputs read in place, forest and
    pointer tables uploaded, packed weights uploaded when a param changed — here through the emulated CUDA
    library on CPU tensors: forward and every gradient equal the cpu module's, over two optimizer steps."""
    for cls, make in ((binary, binary_case), (childsum, None)):
        on_cpu, emulated = _device_case(cls, rng, sparse=sparse and cls is binary)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (on_cpu, emulated)]
        for _ in range(2):
            if make is not None:
                forest, word = make(rng)
                inputs = {"word": torch.as_tensor(word)}
            else:
                forest = Forest.random(4, rng=rng, max_children=3, max_nodes=12)
                inputs = {
                    "x": torch.from_numpy(rng.standard_normal((forest.num_nodes, CHILDSUM["X"])).astype(np.float32))
                }
            batch = ForestBatch.from_forest(forest)
            results, weights = [], None
            for module, optimizer in zip((on_cpu, emulated), optimizers):
                given = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
                out = module(batch, **given)
                if weights is None:  # the same loss for both modules
                    weights = {
                        k: torch.from_numpy(rng.standard_normal(tuple(v.shape)).astype(np.float32))
                        for k, v in out.items()
                    }
                optimizer.zero_grad()
                sum((out[k] * w).sum() for k, w in weights.items()).backward()
                grads = {n: p.grad.to_dense().clone() for n, p in module.named_parameters() if p.grad is not None}
                grads |= {k: v.grad.clone() for k, v in given.items() if v.grad is not None}
                results.append(({k: v.detach().clone() for k, v in out.items()}, grads))
                optimizer.step()
            (out_cpu, grads_cpu), (out_emu, grads_emu) = results
            for key, value in out_cpu.items():
                assert relative_error(out_emu[key].numpy(), value.numpy()) < 1e-5, key
            assert set(grads_emu) == set(grads_cpu)
            for key, value in grads_cpu.items():
                assert relative_error(grads_emu[key].numpy(), value.numpy()) < 1e-4, key
        _, runner = emulated._runner_for(torch.device("cpu"))
        assert runner.backend == "cuda-emu" and runner.repacks == 2  # once per step


@pytest.mark.slow
def test_the_cuda_host_path_reads_and_writes_torch_s_tensors_in_place(childsum, rng, monkeypatch):
    """Device tensors in and out without a copy: the addresses the host path hands the kernels are the
    params', the float input's and the results' own (torch allocates the results), forward and backward."""
    module = CellModule(childsum, seed=1).use_backend("cuda-emu")
    forest = Forest.random(3, rng=rng, max_children=3, max_nodes=9)
    x = torch.from_numpy(rng.standard_normal((forest.num_nodes, CHILDSUM["X"])).astype(np.float32))
    x.requires_grad_(True)
    module(forest, x=x)  # makes the cuda-emu runner
    _, runner = module._runner_for(torch.device("cpu"))
    assert runner.backend == "cuda-emu"
    executor = runner.executor
    seen = {}
    forward_at, backward_at = executor.run_forward_at, executor.run_backward_at

    def spy_forward(lin, packed, arrays, *rest):
        seen["forward"] = {k: list(v) for k, v in arrays.items()}
        return forward_at(lin, packed, arrays, *rest)

    def spy_backward(lin, packed, arrays, grads, *rest):
        seen["backward"] = {k: list(v) for k, v in arrays.items()}
        seen["grads"] = {k: list(v) for k, v in grads.items()}
        return backward_at(lin, packed, arrays, grads, *rest)

    monkeypatch.setattr(executor, "run_forward_at", spy_forward)
    monkeypatch.setattr(executor, "run_backward_at", spy_backward)
    out = module(forest, x=x)
    params = [getattr(module, name) for name in module.runner.params]
    states = [out[name] for name in module.runner.states]
    assert seen["forward"]["params"] == [p.data_ptr() for p in params]
    assert seen["forward"]["inputs"] == [x.data_ptr()]
    assert seen["forward"]["states"] == [s.data_ptr() for s in states]
    (out["h"] * 2).sum().backward()
    assert seen["backward"]["inputs"] == [x.data_ptr()] and seen["backward"]["states"] == seen["forward"]["states"]
    assert len(seen["grads"]["d_params"]) == len(params) and all(seen["grads"]["d_params"])
    assert seen["grads"]["d_inputs"] == [x.grad.data_ptr()]  # torch's gradient is the kernels' array


def _stream_log(lib) -> list[tuple[str, int]]:
    """The emulator's stream log (cuda_emu.h): (what, stream handle) of every launch, copy, memset and sync."""
    lib.cx_emu_stream_log.restype = ctypes.c_int64
    lib.cx_emu_stream_log.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    count = lib.cx_emu_stream_log(None, None, 0)
    ops, streams = np.zeros(count, np.int64), np.zeros(count, np.uint64)
    lib.cx_emu_stream_log(ops.ctypes.data, streams.ctypes.data, count)
    names = ("launch", "cooperative", "copy", "memset", "sync")
    return [(names[op], int(stream)) for op, stream in zip(ops, streams)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["split", "levels"])
def test_the_cuda_runner_takes_torchs_arch_needs_no_pycuda_and_runs_on_torchs_stream(binary, rng, monkeypatch, mode):
    """The runner `.to("cuda")` makes: the arch from torch (nvcc's -arch), no PyCUDA imported, and every
    launch, copy and synchronisation of a call (the packed weights' upload too) on torch's current stream,
    whichever it is; here nvcc is replaced by the emulator build (which records the stream each of them
    names) and the ops run on CPU tensors, against the cpu module, forward and backward."""
    from cortexc.errors import CortexcError
    from cortexc.runtime.abi import LaunchMode, LaunchOptions
    from cortexc.targets.cuda import executor as cuda_runtime
    from cortexc.targets.cuda.emulated import build_emulated
    from cortexc.torch import _Runner
    from cortexc.torch.runner import _SHARED

    monkeypatch.setitem(sys.modules, "pycuda", None)  # importing PyCUDA fails
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 6))
    builds = []

    def build(source, name, source_path=None, compiler=None, flags=(), purpose=""):
        builds.append((name, compiler, flags))
        return build_emulated(source, name)

    monkeypatch.setattr(cuda_runtime, "build_shared", build)
    runner = _Runner(binary, "cuda", 0)
    runner.executor.launch = LaunchOptions(LaunchMode(mode))  # persistent cooperative / one grid per level
    assert builds[0][1] == "nvcc" and "-arch=sm_86" in builds[0][2] and builds[0][0].endswith("_sm86")
    streams = {0: 0x5EED0, 1: 0x5EED1}
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return types.SimpleNamespace(cuda_stream=streams[len(asked) > 1])

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    key = cell_key(binary, "cuda")  # CPU tensors: the key's runner off a GPU (the module has none of its own)
    _SHARED[(key, None)] = runner
    lib = runner.executor.lib
    try:
        module = CellModule(binary, seed=5)
        forest, word = binary_case(rng)
        batch = ForestBatch.from_forest(forest)
        params = [getattr(module, name) for name in runner.params]
        mode_args = (False, torch.zeros((), dtype=torch.int64))  # evaluation mode
        inputs = [torch.as_tensor(word, dtype=torch.int32)]
        lib.cx_emu_stream_log_start()
        got = cell_forward(key, params, inputs, *batch.tensors(), *mode_args)
        forward_log = _stream_log(lib)
        expected = cell_forward(cell_key(binary, "cpu"), params, inputs, *batch.tensors(), *mode_args)
        got_groups, expected_groups = _split(runner, got), _split(module.runner, expected)
        for group in (0, 1, 3):  # states, hoisted rows, outputs (only the CPU runner saves activations)
            for a, b in zip(got_groups[group], expected_groups[group], strict=True):
                assert relative_error(a.detach().numpy(), b.detach().numpy()) < 1e-5
        states, hoisted, activations, outputs = got_groups
        assert activations == []  # a device runner's kernels save nothing
        upstream = [torch.from_numpy(rng.standard_normal(o.shape).astype(np.float32)) for o in outputs]
        backward_args = (*batch.tensors(), states, hoisted, [], [None] * len(states), upstream, *mode_args)
        lib.cx_emu_stream_log_start()
        grads = cell_backward(key, params, inputs, *backward_args)
        backward_log = _stream_log(lib)
        saved = expected_groups[2]  # the CPU runner's own forward's activations
        cpu_args = (*batch.tensors(), states, hoisted, saved, [None] * len(states), upstream, *mode_args)
        expected_grads = cell_backward(cell_key(binary, "cpu"), params, inputs, *cpu_args)
        for a, b in zip(grads, expected_grads):
            assert relative_error(a.detach().numpy(), b.detach().numpy()) < 1e-5
    finally:
        del _SHARED[(key, None)]
    assert asked == [0, 0]  # the runner's device, once per call
    launches = {"split": "cooperative", "levels": "launch"}[mode]
    for log, stream in ((forward_log, streams[0]), (backward_log, streams[1])):
        whats = [what for what, _ in log]
        assert launches in whats and "copy" in whats and whats[-1] == "sync", log
        assert {handle for _, handle in log} == {stream}, log  # nothing on another stream, no device sync
    assert forward_log.count(("copy", streams[0])) == 2  # the packed weights (first call), the call's arena
    with pytest.raises(CortexcError, match="use_backend takes 'cpu' or 'cuda-emu'"):
        module.use_backend("cuda")


def test_a_failed_cuda_call_waits_for_its_stream_before_its_arena_is_reused(childsum, rng, monkeypatch):
    """An entry point that fails (a launch error) returns before synchronising its stream: the executor
    waits for that stream before the call's arena goes back to the pool (a call on another stream could
    take it while the upload still runs) and raises a typed error."""
    module = CellModule(childsum, seed=1).use_backend("cuda-emu")
    forest = Forest.random(3, rng=rng, max_children=3, max_nodes=9)
    x = torch.from_numpy(rng.standard_normal((forest.num_nodes, CHILDSUM["X"])).astype(np.float32))
    module(forest, x=x)  # makes the runner
    _, runner = module._runner_for(torch.device("cpu"))
    executor = runner.executor
    events = []
    monkeypatch.setattr(runner, "stream", lambda: 0x77)
    monkeypatch.setattr(executor.lib, "cx_forward", lambda *args: 719)  # cudaErrorLaunchFailure
    sync, give_back = executor.memory.sync, executor.pool.give_back
    monkeypatch.setattr(executor.memory, "sync", lambda stream=0: (events.append(("sync", stream)), sync(stream)))
    monkeypatch.setattr(executor.pool, "give_back", lambda block: (events.append(("give_back", 0)), give_back(block)))
    with pytest.raises(CortexcError, match="the CUDA forward failed with cudaError 719"):
        module(forest, x=x)
    assert events == [("sync", 0x77), ("give_back", 0)]


@pytest.mark.slow
def test_the_numpy_api_on_cuda_runs_on_the_default_stream(binary, rng):
    """The NumPy API (what PyCUDA drives on a GPU) passes no stream: every copy, launch and sync of its calls
    is on the default stream (handle 0), forward and backward."""
    model = binary(device="cuda-emu", seed=2)
    forest, word = binary_case(rng)
    lib = model._executor_for_device().lib
    lib.cx_emu_stream_log_start()
    out = model(forest, grad=True, word=word)
    model.backward(out, {"logits": np.ones_like(out["logits"])})
    log = _stream_log(lib)
    assert {"launch", "cooperative"} & {what for what, _ in log} and {"copy", "memset", "sync"} <= {w for w, _ in log}
    assert {stream for _, stream in log} == {0}, log


# ------------------------------------------------------------------------------------------- dropout
DROPOUT = {"V": 40, "X": 6, "H": 5, "C": 3}


@pytest.fixture(scope="module")
def dropout_cell():
    return cortexc.load(EXAMPLES / "treelstm_dropout.cell", **DROPOUT).DropoutTreeLSTM


def _drawn_seed(k: int) -> int:
    """The seed a training-mode call draws after torch.manual_seed(k) (torch's default generator)."""
    torch.manual_seed(k)
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)) % 2**64


def test_train_and_eval_drive_dropout_with_torch_s_generator(dropout_cell, rng):
    module, reference = jittered(dropout_cell, rng)
    forest, word = binary_case(rng)
    assert module.training
    seed = _drawn_seed(11)
    torch.manual_seed(11)
    out = module(forest, word=torch.as_tensor(word))
    expected = reference(forest, grad=True, train=True, dropout_seed=seed, word=word)
    assert relative_error(out["logits"].detach().numpy(), expected["logits"]) < 1e-5
    up = rng.standard_normal(expected["logits"].shape).astype(np.float32)
    (out["logits"] * torch.from_numpy(up)).sum().backward()
    grads = reference.backward(expected, {"logits": up})
    for name, param in module.named_parameters():
        assert relative_error(param.grad.numpy(), grads[name]) < 1e-4, name
    # the same generator state reproduces the call; another draw gives other masks
    torch.manual_seed(11)
    again = module(forest, word=torch.as_tensor(word))
    assert torch.equal(again["logits"], out["logits"])
    assert not torch.equal(module(forest, word=torch.as_tensor(word))["logits"], out["logits"])
    # evaluation mode: no dropout, and torch's generator is not touched
    module.eval()
    state = torch.get_rng_state()
    plain = module(forest, word=torch.as_tensor(word))
    assert torch.equal(torch.get_rng_state(), state)
    assert relative_error(plain["logits"].detach().numpy(), reference(forest, word=word)["logits"]) < 1e-5


@pytest.mark.slow
def test_opcheck_and_compile_with_dropout_in_training_mode(dropout_cell, rng):
    from torch._dynamo.utils import counters

    module = CellModule(dropout_cell)
    forest, word = binary_case(rng)
    batch = ForestBatch.from_forest(forest)
    params = [getattr(module, n).detach().clone().requires_grad_(True) for n in module.runner.params]
    inputs = [torch.as_tensor(word, dtype=torch.int32)]
    seed = torch.tensor(-12345, dtype=torch.int64)  # two's complement: 2^64 - 12345
    key = cell_key(dropout_cell, "cpu")
    args = (key, params, inputs, *batch.tensors(), True, seed)
    torch.library.opcheck(cell_forward, args)
    results = cell_forward(*args)
    states, hoisted, activations, _ = ([r.detach() for r in group] for group in _split(module.runner, results))
    torch.library.opcheck(
        cell_backward,
        (
            key,
            [p.detach() for p in params],
            inputs,
            *batch.tensors(),
            states,
            hoisted,
            activations,
            [None, None],
            [torch.randn(results[-1].shape)],
            True,
            seed,
        ),
    )
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    out = compiled(batch, word=torch.as_tensor(word))
    out["logits"].sum().backward()
    torch.manual_seed(3)
    assert torch.equal(out["logits"], module(batch, word=torch.as_tensor(word))["logits"])
    assert not counters["graph_break"], dict(counters["graph_break"])


# ------------------------------------------------------------------------------- examples/train_sst_torch.py
SMALL_RUN = ["--limit", "50", "--eval-limit", "12", "--epochs", "2", "--hidden", "6", "--embed", "5"]


def _sst_torch_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_sst_torch_example", EXAMPLES / "train_sst_torch.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


@pytest.mark.slow
def test_the_train_sst_torch_example_trains_in_train_mode_evaluates_in_eval_mode(tmp_path, monkeypatch, capsys):
    """Two epochs of two steps on 50 SST trees: every training step runs the cell's read-out dropout
    (training mode, with a gradient), every dev/test evaluation runs in evaluation mode under no_grad;
    the best state_dict is saved under the .cell names and reproduces the best dev accuracy printed."""
    from tests.helpers import sst_path

    sst_path("train")
    example = _sst_torch_example()
    calls = []
    forward = CellModule.forward

    def spy(self, batch, **inputs):
        calls.append((self.training, torch.is_grad_enabled(), self.runner.dropout_sites))
        return forward(self, batch, **inputs)

    monkeypatch.setattr(CellModule, "forward", spy)
    save = tmp_path / "best.pt"
    assert example.main([*SMALL_RUN, "--save", str(save)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("test root acc") == 2
    assert calls[:2] == [(True, True, 1)] * 2  # epoch 1: two steps of 25 trees, dropout on
    assert calls[2:4] == [(False, False, 1)] * 2  # dev, test: dropout off, no graph
    assert calls[4:] == calls[:4]  # epoch 2
    best = float(printed.split("best dev root accuracy ")[1].split(";")[0])
    state = torch.load(save)
    train = example.read_trees(example.SST / "train.txt", 50)
    vocab = cortexc.Vocab.build(train, min_count=1)
    cls = cortexc.load(EXAMPLES / "sst_treelstm.cell", V=len(vocab), X=5, H=6, C=5).SSTTreeLSTM
    assert list(state) == [p.name for p in cls.signature.params]
    module = CellModule(cls)
    assert not torch.equal(state["W_s"], module.W_s.detach())  # trained, not the init
    module.load_state_dict(state)
    module.eval()
    dev = example.read_trees(example.SST / "dev.txt", 12)
    assert abs(example.root_accuracy(module, dev, vocab) - best) < 1e-4


@pytest.mark.slow
def test_the_train_sst_torch_example_trains_on_two_ddp_ranks(tmp_path):
    """`--ddp 2`: two gloo processes on 127.0.0.1 train one epoch; rank 0 reports and saves."""
    from tests.api.test_torch_ddp import _free_port
    from tests.helpers import sst_path

    sst_path("train")
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    save = tmp_path / "best.pt"
    small = ["--limit", "50", "--eval-limit", "12", "--epochs", "1", "--hidden", "6", "--embed", "5"]
    command = [sys.executable, str(EXAMPLES / "train_sst_torch.py"), *small, "--ddp", "2", "--save", str(save)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("test root acc") == 1 and "best dev root accuracy" in done.stdout
    assert list(torch.load(save)) == ["E", "W_iou", "b_iou", "U_iou", "U_f", "b_f", "W_s", "b_s"]
