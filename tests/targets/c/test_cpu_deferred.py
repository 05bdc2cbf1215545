"""The CPU backward's deferred weight gradients: the kernels only keep each AccumOuter term's factor rows
and one GEMM per term after the recursion adds them (driver_c_deferred.j2). A narrow term (a small weight)
is kept only by launches of few rows (`cx_narrow_launch`), the others add it per tile."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.codegen.render import NARROW_ROWS
from cortexc.ir.program import AccumOuter, AccumSum
from cortexc.options import CompileOptions
from cortexc.pipeline import Source, run_stages
from cortexc.targets.c.target import DEFER_MIN_WIDTH_C
from tests.helpers import EXAMPLES, declared_dims, random_inputs, relative_error, twin_models


def _c_source(path, cell=0, **dims):
    """The program (C target) and C text of the file's cell number `cell`."""
    options = CompileOptions(targets=("c",), defines=tuple(dims.items())) if dims else CompileOptions(targets=("c",))
    rendered = run_stages(Source(path.read_text(encoding="utf-8"), str(path)), options, until="render")[cell]
    (variant,) = rendered.programs
    return variant.program, dict(rendered.sources)["c"]


#: every cell of every example file, as (path, its number in the file)
EXAMPLE_CELLS = [
    (path, index)
    for path in sorted(EXAMPLES.glob("*.cell"))
    for index in range(len(re.findall(r"^cell ", path.read_text(encoding="utf-8"), re.M)))
]


def _function(text: str, name: str) -> str:
    """The body of the C function `name` (from its definition to the next function at column 0)."""
    start = re.search(rf"^static void {name}\(", text, re.M)
    assert start, name
    end = text.index("\n}\n", start.end())
    return text[start.end() : end]


#: dims at which every weight of the examples is large enough to be deferred on C (DEFER_MIN_WIDTH_C)
LARGE = {"X": 200, "H": 200, "C": 200}


@pytest.mark.parametrize("large", [True, False], ids=["large", "declared"])
@pytest.mark.parametrize(("path", "cell"), EXAMPLE_CELLS, ids=[f"{p.stem}-{i}" for p, i in EXAMPLE_CELLS])
def test_the_cpu_backward_keeps_factor_rows_instead_of_accumulating(path, cell, large):
    """A deferred term's kernel writes its factor rows and adds no outer product per tile, and the deferred
    phase reads them; a small one (below DEFER_MIN_WIDTH_C) is narrow: its kernel both keeps its rows and
    adds it per tile (by the launch's `stage->narrow`), and the deferred phase reads the rows of the
    launches that kept them; the chunk accumulators hold only what may be summed per tile."""
    program, text = _c_source(path, cell, **(declared_dims(path, LARGE) if large else {}))
    terms = program.deferred or ()
    deferred = {(t.kernel, t.step): index for index, t in enumerate(terms)}
    phase = _function(text, "cx_deferred_phase") if deferred else ""
    per_tile, by_kernel = set(), {}
    for kernel in program.kernels:
        body = _function(text, f"cx_kernel_{kernel.name}")
        outer = [n for n, s in enumerate(kernel.steps) if isinstance(s, AccumOuter)]
        assert all((kernel.name, n) in deferred for n in outer), "the C target defers every weight gradient"
        narrow = [n for n in outer if terms[deferred[(kernel.name, n)]].narrow]
        assert body.count("cx_gemm_tn_acc(") == len(narrow), kernel.name
        assert body.count("if (!stage->narrow)") == len(narrow), kernel.name
        for n in outer:
            step, index = kernel.steps[n], deferred[(kernel.name, n)]
            assert f"grad->deferred[{index}] + " in body
            small = step.m * step.k < DEFER_MIN_WIDTH_C * (step.m + step.k)
            assert terms[index].narrow == small
            if small:
                per_tile.add(step.param)
                kept = (
                    f"cx_deferred_levels(call, grad, grad->deferred[{index}],"
                    if kernel.rows.name == "LEVEL"
                    else f"cx_deferred_block(grad->deferred[{index}],"
                )
                assert phase.count(kept) == 1
            else:
                assert phase.count(f"cx_deferred_block(grad->deferred[{index}],") == 1
        by_kernel[kernel.name] = {s.param for s in kernel.steps if isinstance(s, AccumSum)}
        by_kernel[kernel.name] |= {kernel.steps[n].param for n in narrow}
        per_tile |= by_kernel[kernel.name]
    assert any(not t.narrow for t in terms) or not large
    floats = sum(int(np.prod(program.cell.param(name).shape)) for name in per_tile)
    assert f"cx_accs_init(&chunks, cx_acc_offset, cx_acc_size, {floats});" in text  # a chunk's floats
    # each kernel's launches zero (and the sums read) the regions of the params its tiles add to, no others
    regions = [name for name, _, _ in program.accumulators if name in per_tile]
    for kernel, params in by_kernel.items():
        listed = sorted(regions.index(name) for name in params)
        declaration = f"static const int cx_regions_{kernel}[] = {{{', '.join(map(str, [*listed, -1]))}}};"
        assert (declaration in text) == bool(listed), declaration


def _poison(model) -> None:
    """NaN in this thread's reused factor-row buffers: a row the kernels leave unwritten would show."""
    scratch = model._executor_for_device()._scratch
    deferred = [array for (slot, _), array in scratch.slots.items() if slot == "deferred"]
    assert deferred
    for array in deferred:
        array[...] = np.nan


def _gradients_twice(model, reference, forest, inputs, upstream):
    """The compiled gradients of a second backward (the first leaves its buffers poisoned) and the
    interpreter's."""
    model.backward(model(forest, grad=True, **inputs), upstream)
    _poison(model)
    return model.backward(model(forest, grad=True, **inputs), upstream), reference.backward(
        reference(forest, grad=True, **inputs), upstream
    )


# dims that cross the deferred phase's output blocks (128 rows x 64 columns) and forests whose terms have
# more rows than one pass over them (64): DAG per-child-edge terms, and params with several terms
CASES = [
    ("dagrnn.cell", {"X": 200, "H": 200}, lambda rng: Forest.random_dag(300, rng=rng)),
    ("treelstm.cell", {"X": 200, "H": 200}, lambda rng: Forest.random(20, rng=rng, max_children=4, max_nodes=15)),
    ("binary_treelstm.cell", {"X": 100, "H": 100, "V": 30}, lambda rng: Forest.random(20, rng=rng, binary=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, dims, make_forest", CASES, ids=[c[0] for c in CASES])
def test_deferred_gradients_match_the_interpreter(name, dims, make_forest, rng, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    path = EXAMPLES / name
    program, _ = _c_source(path, **dims)
    terms = {t.param: 0 for t in program.deferred}
    for term in program.deferred:
        terms[term.param] += 1
    kinds = {t.rows.value for t in program.deferred}
    module = cortexc.load(path, out_dir=tmp_path_factory.mktemp("pkg"), **dims)
    model, reference = twin_models(module, "cpu", 5, rng)
    forest = make_forest(rng)
    inputs = random_inputs(model.cell, forest, rng)
    expected = reference(forest, **inputs)
    upstream = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in expected.items()}
    grads, expected_grads = _gradients_twice(model, reference, forest, inputs, upstream)
    assert set(grads) == set(expected_grads)
    for key, value in expected_grads.items():
        assert relative_error(grads[key], value) < 2e-5, f"d{key}"
    if name != "binary_treelstm.cell":
        assert max(terms.values()) >= 2 and "child" in kinds, "several terms on a param, terms per child edge"


@pytest.mark.slow
def test_a_skipped_output_leaves_its_term_out(rng, tmp_path_factory, monkeypatch):
    """Without the upstream gradient of an output its gradient kernel does not run, so its term's rows are
    not written (not zeroed either): the deferred phase must skip the term."""
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    dims = {"X": 9, "H": 200, "V": 20, "C": 200}  # W_s (C x H) deferred
    path = EXAMPLES / "binary_treelstm.cell"
    program, text = _c_source(path, **dims)
    assert "W_s" in {t.param for t in program.deferred} and "if (grad->upstream[0])" in text
    module = cortexc.load(path, out_dir=tmp_path_factory.mktemp("pkg"), **dims)
    model, reference = twin_models(module, "cpu", 2, rng)
    forest = Forest.random(6, rng=rng, binary=True)
    inputs = random_inputs(model.cell, forest, rng)
    out = reference(forest, **inputs)
    both = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in out.items()}
    model.backward(model(forest, grad=True, **inputs), both)  # writes every term's rows
    _poison(model)
    upstream = {"h": both["h"]}
    grads = model.backward(model(forest, grad=True, **inputs), upstream)
    expected = reference.backward(reference(forest, grad=True, **inputs), upstream)
    assert not grads["W_s"].any() and not grads["b_s"].any()
    for key, value in expected.items():
        assert relative_error(grads[key], value) < 2e-5, f"d{key}"


@pytest.mark.slow
def test_the_torch_cpu_op_passes_the_factor_rows(rng, tmp_path_factory, monkeypatch):
    """`cortexc.torch` on CPU gives the executor no factor rows of its own: the backward takes this
    thread's scratch (poisoned here first), and the gradients still match the interpreter."""
    torch = pytest.importorskip("torch")
    from cortexc.torch import CellModule, ForestBatch

    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    dims = {"X": 9, "H": 200, "V": 20, "C": 3}  # U_iou, U_f deferred
    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell", out_dir=tmp_path_factory.mktemp("pkg"), **dims).BinaryTreeLSTM
    module = CellModule(cls, seed=4)
    reference = cls(device="interp", seed=4)
    reference.load_params({k: v.detach().numpy() for k, v in module.state_dict().items()})
    forest = Forest.random(5, rng=rng, binary=True)
    word = rng.integers(0, dims["V"], forest.num_nodes)
    batch = ForestBatch.from_forest(forest)
    module(batch, word=torch.as_tensor(word))["h"].sum().backward()  # makes the scratch
    executors = [module.runner.executor]
    for executor in executors:
        for (slot, _), array in executor._scratch.slots.items():
            if slot == "deferred":
                array[...] = np.nan
    assert any(slot == "deferred" for e in executors for slot, _ in e._scratch.slots)
    module.zero_grad()
    out = module(batch, word=torch.as_tensor(word))
    expected = reference(forest, grad=True, word=word)
    upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
    sum((out[k] * torch.from_numpy(g)).sum() for k, g in upstream.items()).backward()
    for name, value in reference.backward(expected, upstream).items():
        assert relative_error(getattr(module, name).grad.numpy(), value) < 2e-5, name


def _chain(length: int) -> Forest:
    return Forest.from_parents(np.append(np.arange(1, length), -1))


#: cells at dims where every weight gradient is narrow, on forests whose backward has launches of few rows and
#: of many: a long chain beside a batch of short ones (levels of 21 rows, then of one), random trees and a
#: random DAG (wide levels at the bottom), each beside a chain deeper than they are (levels of one row at the
#: top, whatever the seed; the DAG-RNN's terms have a row per child edge)
NARROW_CASES = {
    "lstm_chains": (
        "lstm.cell",
        {"X": 32, "H": 64},
        lambda rng: Forest.concat([_chain(40)] + [_chain(10)] * 20),
    ),
    "treelstm_trees": (
        "treelstm.cell",
        {"X": 16, "H": 32},
        lambda rng: Forest.concat([Forest.random(60, rng=rng, max_children=3), _chain(80)]),
    ),
    "dagrnn_dag": (
        "dagrnn.cell",
        {"X": 16, "H": 48},
        lambda rng: Forest.concat([Forest.random_dag(400, rng=rng), _chain(80)]),
    ),
}


@pytest.mark.parametrize("case", sorted(NARROW_CASES))
def test_narrow_terms_match_the_interpreter_whichever_launches_keep_their_rows(
    case, rng, tmp_path_factory, monkeypatch
):
    """With the package's bound, with no launch keeping rows (`narrow_rows` 1: all per tile) and with every
    launch keeping them, on forests with narrow and wide launches, the gradients match the interpreter. The
    factor rows are poisoned before each backward, so a deferred phase that read the rows of a launch that
    added its term per tile would give NaN."""
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    name, dims, make_forest = NARROW_CASES[case]
    path = EXAMPLES / name
    program, _ = _c_source(path, **dims)
    assert program.deferred and all(t.narrow for t in program.deferred)
    module = cortexc.load(path, out_dir=tmp_path_factory.mktemp("pkg"), **dims)
    model, reference = twin_models(module, "cpu", 3, rng)
    forest = make_forest(rng)
    widths = np.diff(forest.level_ptr)
    assert widths.min() < NARROW_ROWS <= widths.max(), "narrow and wide launches"
    inputs = random_inputs(model.cell, forest, rng)
    expected = reference(forest, **inputs)
    upstream = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in expected.items()}
    executor = model._executor_for_device()
    results = {}
    try:
        for narrow_rows in (0, 1, 1 << 40):
            executor.narrow_rows = narrow_rows
            grads, expected_grads = _gradients_twice(model, reference, forest, inputs, upstream)
            for key, value in expected_grads.items():
                assert relative_error(grads[key], value) < 2e-5, f"d{key} at narrow_rows={narrow_rows}"
            results[narrow_rows] = grads
    finally:
        executor.narrow_rows = 0
    # the three split the rows differently between the chunks and the deferred phase: other sums
    weight = program.deferred[0].param
    assert not np.array_equal(results[0][weight], results[1][weight])
    assert not np.array_equal(results[0][weight], results[1 << 40][weight])
