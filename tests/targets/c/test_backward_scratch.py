"""The CPU backward's work arrays are recycled per thread and mostly not zero-filled, and a sparse embedding
gradient is computed in a table kept zeroed between calls. None of it may change a gradient: here the
memory starts as (or is poisoned to) NaN, upstream gradients cover only some outputs and states, Saved
results are used twice and out of order, threads run backwards at once, and the sparse rows equal the
dense gradient's rows bit for bit, on random forests and SST trees."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import cortexc
import cortexc.targets.c.memory as cpu_memory
from cortexc import Forest
from cortexc.codegen.module import hoisted_gradients_set
from cortexc.ir.program import KernelRole, Store, StoreMode, StoreTarget
from cortexc.options import CompileOptions
from cortexc.pipeline import Source, run_stages
from cortexc.runtime.model import SparseRows
from tests.helpers import (
    EXAMPLES,
    SMALL_EXAMPLES,
    load_small_examples,
    random_inputs,
    relative_error,
    small_example_forest,
    sst_path,
)
from tests.helpers import first_model as _model


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return load_small_examples(tmp_path_factory.mktemp("bwdscratch"))


def _forest(key: str, rng: np.random.Generator, size: int = 16) -> Forest:
    return small_example_forest(key, rng, size)


def _upstreams(out, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """The last state (or output) alone, then all of them: a state without an upstream starts at zero."""
    full = {name: rng.standard_normal(np.shape(value)).astype(np.float32) for name, value in out.items()}
    last = list(full)[-1]
    return [{last: full[last]}, full]


def _poison(executor) -> None:
    """NaN into this thread's backward scratch (a zero-fill that a kernel needs and that is missing shows)."""
    for flat in executor._scratch.slots.values():
        flat[...] = np.nan


@pytest.mark.parametrize("key", list(SMALL_EXAMPLES))
def test_backward_from_nan_memory_with_partial_upstreams_matches_the_interpreter(key, modules, rng, monkeypatch):
    """The backward's state gradients, hoisted gradients and deferred rows start as NaN memory (fresh and
    recycled), with the upstream gradient of one output or state, then of all: every gradient is finite and
    equals the interpreter's (a state gradient not zeroed where no upstream is given, or a hoisted gradient
    read before it is set, would show)."""
    monkeypatch.setattr(cpu_memory, "_empty", lambda shape, dtype: np.full(shape, np.nan, dtype))
    model = _model(modules[key])
    reference = _model(modules[key], device="interp")
    executor = model._executor_for_device()
    forest = _forest(key, rng)
    inputs = random_inputs(model.signature, forest, rng)
    out, expected = model(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    for upstream in _upstreams(expected, rng):
        grads, want = model.backward(out, upstream), reference.backward(expected, upstream)
        assert grads.keys() == want.keys()
        for name, value in want.items():
            assert np.isfinite(grads[name]).all(), f"{list(upstream)}: d{name}"
            assert relative_error(grads[name], value) < 1e-5, f"{list(upstream)}: d{name}"
        _poison(executor)  # the next backward reuses this memory


@pytest.mark.parametrize("key", ["lstm", "binary_treelstm", "dagrnn"])
def test_recycled_backward_memory_gives_a_fresh_models_gradients(key, modules, rng):
    """Forests that grow and shrink, scratch poisoned before each backward, a Saved used twice and two
    Saved taken out of order: every gradient equals a fresh model's bit for bit, and gradients returned
    earlier are not changed by later backwards (they are the caller's own arrays, not scratch)."""
    model = _model(modules[key])
    executor = model._executor_for_device()
    forests = [_forest(key, np.random.default_rng(seed), size) for seed, size in enumerate([60, 10, 80, 5])]
    cases = []
    for forest in forests:
        inputs = random_inputs(model.signature, forest, rng)
        fresh = _model(modules[key])
        want = fresh(forest, grad=True, **inputs)
        upstream = _upstreams(want, rng)[0]  # one output or state: the others' gradients start at zero
        cases.append((model(forest, grad=True, **inputs), upstream, fresh.backward(want, upstream)))
    kept = []
    for out, upstream, want in [*cases[::-1], *cases]:  # out of order, then each Saved a second time
        _poison(executor)
        grads = model.backward(out, upstream)
        kept.append((grads, {name: value.copy() for name, value in grads.items()}))
        assert grads.keys() == want.keys()
        for name, value in want.items():
            assert (grads[name] == value).all(), f"d{name}"
    for grads, copies in kept:
        for name, value in copies.items():
            assert (grads[name] == value).all(), f"d{name} changed by a later backward"


def test_hoisted_gradients_are_zeroed_only_where_no_kernel_sets_them(modules):
    """The rule that lets the backward skip zeroing a hoisted gradient is the compiler's, written into the
    target's section of `cell.json`: the examples' node gradient kernels SET every hoisted gradient; a
    program without that store (a hoisted value with no gradient) means zeros, and a store by some other
    kernel (not on every internal node) is no proof."""
    assert _model(modules["lstm"])._executor_for_device().section.hoisted_gradients_set == (True,)
    program = _c_program(EXAMPLES / "lstm.cell")
    assert hoisted_gradients_set(program) == (True,)

    def edited(keep, extra=()):
        kernels = []
        for kernel in program.kernels:
            steps = tuple(s for s in kernel.steps if keep(kernel, s))
            steps += tuple(extra) if kernel.role == KernelRole.GRAD_PRE else ()
            kernels.append(dataclasses.replace(kernel, steps=steps))
        return dataclasses.replace(program, kernels=tuple(kernels))

    def not_hoisted(kernel, step):
        return not (isinstance(step, Store) and step.target == StoreTarget.D_HOISTED)

    assert hoisted_gradients_set(edited(not_hoisted)) == (False,)
    elsewhere = Store(0, StoreTarget.D_HOISTED, "pre0", 1, mode=StoreMode.SET)
    assert hoisted_gradients_set(edited(not_hoisted, [elsewhere])) == (False,)


def _c_program(path):
    options = CompileOptions.make(targets=("c",))
    ((variant,),) = run_stages(Source(path.read_text(encoding="utf-8"), str(path)), options, until="target")
    return variant.program


# ----------------------------------------------------------------------------- sparse embedding gradients


def _sparse_cases(module, rng: np.random.Generator, sst_lines: list[str] | None = None):
    model = _model(module)
    forests = [Forest.random(int(t), rng=rng, max_children=2) for t in rng.integers(1, 12, 4)]
    if sst_lines:
        forests += [Forest.from_ptb(sst_lines[i : i + 25]) for i in (0, 25)]
    return model, forests


def _check_sparse_equals_dense(model, forests, rng, vocab: int) -> None:
    executor = model._executor_for_device()
    for forest in forests:
        words = rng.integers(0, vocab, forest.num_nodes).astype(np.int64)
        if forest.num_nodes > 3:
            words[: forest.num_nodes // 2] = words[0]  # rows looked up many times
        out = model(forest, grad=True, word=words)
        upstream = {"logits": rng.standard_normal(out["logits"].shape).astype(np.float32)}
        sparse = model.backward(out, upstream, sparse=True)
        dense = model.backward(model(forest, grad=True, word=words), upstream)
        assert sparse.keys() == dense.keys()
        for name, value in dense.items():
            got = sparse[name]
            if isinstance(got, SparseRows):
                assert (got.rows == np.unique(words[forest.num_children == 0])).all()
                assert got.shape == value.shape
                got = got.to_dense()
            assert (got == value).all(), f"d{name}"
        for table in executor._scratch.tables.values():  # zero again after use
            assert not table.any()


def test_sparse_embedding_gradient_equals_the_dense_rows_bitwise(modules, rng):
    model, forests = _sparse_cases(modules["binary_treelstm"], rng)
    _check_sparse_equals_dense(model, forests, rng, vocab=64)


@pytest.mark.slow
def test_sparse_embedding_gradient_on_sst_trees(tmp_path, rng):
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()][:50]
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", tmp_path / "sst", V=18282, X=30, H=20)
    model, forests = _sparse_cases(module, rng, lines)
    _check_sparse_equals_dense(model, forests, rng, vocab=18282)


def test_a_failed_sparse_backward_drops_the_table(modules, rng, monkeypatch):
    """A backward that fails after the C code may have written the table leaves no dirty table behind."""
    model = _model(modules["binary_treelstm"])
    executor = model._executor_for_device()
    forest = Forest.random(3, rng=rng, max_children=2)
    words = rng.integers(0, 64, forest.num_nodes).astype(np.int64)
    out = model(forest, grad=True, word=words)
    upstream = {"logits": np.ones(out["logits"].shape, np.float32)}
    want = model.backward(out, upstream, sparse=True)
    run_backward = executor.run_backward

    def failing(*args, **kwargs):
        run_backward(*args, **kwargs)
        raise cortexc.CortexcError("failed after writing")

    monkeypatch.setattr(executor, "run_backward", failing)
    with pytest.raises(cortexc.CortexcError):
        model.backward(out, upstream, sparse=True)
    assert not executor._scratch.tables
    monkeypatch.undo()
    again = model.backward(out, upstream, sparse=True)
    assert (again["E"].values == want["E"].values).all()


def test_concurrent_sparse_and_dense_backwards_on_one_model(modules, rng):
    """Threads taking sparse and dense gradients of one model at once (each thread has its own scratch and
    zeroed table) get the sequential results bit for bit."""
    model = _model(modules["binary_treelstm"])
    cases = []
    for seed in range(4):
        forest = Forest.random(5, rng=np.random.default_rng(seed), max_children=2)
        words = rng.integers(0, 64, forest.num_nodes).astype(np.int64)
        out = model(forest, grad=True, word=words)
        upstream = {"logits": rng.standard_normal(out["logits"].shape).astype(np.float32)}
        cases.append((forest, words, upstream, model.backward(out, upstream)))
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(thread: int) -> None:
        start.wait()
        for step in range(12):
            forest, words, upstream, want = cases[(thread + step) % len(cases)]
            out = model(forest, grad=True, word=words)
            grads = model.backward(out, upstream, sparse=step % 2 == 0)
            for name, value in want.items():
                got = grads[name]
                got = got.to_dense() if isinstance(got, SparseRows) else got
                if not (got == value).all():
                    errors.append(f"thread {thread} step {step}: d{name}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:5]
