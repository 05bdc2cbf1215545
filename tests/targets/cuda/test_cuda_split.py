"""Split mode of the CUDA target ("model persistence"): small levels shared among thread blocks by
columns, each block keeping its slice of the weights in shared memory. The analysis that decides which
kernels may split (`cortexc.passes.columns`) is checked on the examples and on invented cells; the
emitted code runs on the CPU emulator against the interpreter with blocks owning one, several and a
ragged number of hidden units, with the slices in shared and in global memory, and with levels large
enough to go by row tiles in the same launch."""

from __future__ import annotations

import ctypes

import pytest

import cortexc
from cortexc import Forest
from cortexc.passes.columns import split_columns, why_not
from cortexc.passes.schedule import schedule
from tests.helpers import EXAMPLES, load_example, random_inputs, relative_error, small_forest, twin_models

INVENTED = {
    # a second GEMM on the first one's result: a node would need every block's columns
    "two_layer": """
cell TwoLayer on tree(arity = 2) {
    dim X = 5, H = 6
    input x[X]
    param W_leaf[H, X], W1[H, 2*H], W2[H, H], b[H]
    state h[H]
    leaf { h = tanh(W_leaf @ x + b) }
    node { z = tanh(W1 @ concat(child[0].h, child[1].h) + b)
           h = tanh(W2 @ z) }
}
""",
    # slices one column apart: no period above 1, nothing to split
    "odd_offset": """
cell OddOffset on tree {
    dim X = 5, H = 6
    input x[X]
    param W[H, X], U[H + 1, H]
    state h[H]
    node { g = U @ sum(child.h)
           h = tanh(g[0:H] * g[1:H + 1] + W @ x) }
}
""",
    # slices 4 columns apart: the period is 4, not H
    "quarter": """
cell Quarter on tree {
    dim X = 5, H = 8
    input x[X]
    param W[2*H, X], U[2*H, H], b[2*H]
    state h[H]
    node { g = W @ x + U @ sum(child.h) + b
           h = tanh(g[4:12]) * sigmoid(g[0:8]) + g[8:16] }
}
""",
    # a GEMM over child edges, a max over children, a softmax and a scalar every block computes whole
    "gated_max": """
cell GatedMax on tree {
    dim X = 5, H = 6
    input x[X]
    param W[H, X], W_a[H, X], U[H, H], b[H]
    state h[H]
    node { a = softmax(W_a @ x)
           m = max(tanh(U @ child.h + b))
           h = (m + W @ x) * a / (1 + sum(1)) }
}
""",
}

EXPECTED_PERIODS = {
    "binary_treelstm": 150,
    "treelstm": 150,
    "lstm": 64,
    "dagrnn": 64,
    "treernn": 64,
    "mvrnn": 16,
    "two_layer": None,
    "odd_offset": None,
    "quarter": 4,
    "gated_max": 6,
}


def _node_kernel(source: str, name: str):
    cell = cortexc.compile_source(source, f"{name}.cell")[0]
    return split_columns(schedule(cell)).kernel("node")


def test_the_leaf_kernel_splits_with_the_node_kernels_period():
    """One ownership of columns serves the whole launch: every example's leaf kernel splits with H too;
    a leaf kernel whose period differs from the node kernel's stays whole."""
    for path in sorted(EXAMPLES.glob("*.cell")):
        program = split_columns(schedule(cortexc.compile_file(path)[0]))
        # a score w_a @ tanh(W_a @ child.h), the RNTN's (T @ hc) @ hc, the GGNN's message m (the operand of
        # W_z @ m), or a relation's rows chosen from all R products (U[edge.rel] @ child.h), needs a GEMM result whole
        if path.stem in ("attn_treelstm", "rntn", "ggnn", "typed_daglstm"):
            assert why_not(program.kernel("node")).startswith("the GEMM result")
            assert program.kernel("node").split is None and program.kernel("leaf").split is None
            continue
        assert program.kernel("leaf").split.period == program.kernel("node").split.period, path.stem
    source = """
cell Mismatch on tree(arity = 2) {
    dim X = 4, H = 6
    input x[X]
    param W_leaf[H, X], W[H, 2*H], b[H]
    state h[H]
    leaf { g = W_leaf @ x
           h = concat(tanh(g[0:2]), g[2:4] * g[4:6], g[0:2]) }
    node { h = tanh(W @ concat(child[0].h, child[1].h) + b) }
}
"""
    program = split_columns(schedule(cortexc.compile_source(source, "mismatch.cell")[0]))
    assert program.kernel("node").split.period == 6
    assert program.kernel("leaf").split is None


@pytest.mark.parametrize("name", sorted(EXPECTED_PERIODS))
def test_which_node_kernels_split_and_their_period(name):
    path = EXAMPLES / f"{name}.cell"
    source = path.read_text() if path.exists() else INVENTED[name]
    kernel = _node_kernel(source, name)
    expected = EXPECTED_PERIODS[name]
    if expected is None:
        assert kernel.split is None
        assert why_not(kernel)
    else:
        assert kernel.split is not None and kernel.split.period == expected
        assert len(kernel.split.split_steps) == len(kernel.steps)
        assert any(kernel.split.split_steps)


def test_why_a_kernel_does_not_split():
    assert why_not(_node_kernel(INVENTED["two_layer"], "two_layer")).endswith("is needed whole")
    assert why_not(_node_kernel(INVENTED["odd_offset"], "odd_offset")) == "no column period above 1"
    mvrnn = _node_kernel((EXAMPLES / "mvrnn.cell").read_text(), "mvrnn")
    assert why_not(mvrnn) == ""  # its per-node matrix products are computed whole by every block
    assert not all(mvrnn.split.split_steps)


def test_the_period_follows_the_dims():
    source = (EXAMPLES / "binary_treelstm.cell").read_text()
    for hidden in (7, 64, 256):
        cell = cortexc.compile_source(source, "b.cell", {"H": hidden})[0]
        assert split_columns(schedule(cell)).kernel("node").split.period == hidden


def test_the_c_target_never_splits(tmp_path):
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", out_dir=tmp_path, H=8, X=4, V=10, C=3)
    source = next(p for p in __import__("pathlib").Path(next(iter(module.__path__))).glob("*.c"))
    text = source.read_text()
    assert "cx_gemm_cols" not in text and "cx_u0" not in text


def _last_plan(model) -> tuple[int, int, int]:
    out = (ctypes.c_int64 * 3)()
    model._executor_for_device().lib.cx_last_plan(out)
    return out[0], out[1], out[2]


@pytest.fixture(scope="module")
def split_packages(tmp_path_factory):
    out = tmp_path_factory.mktemp("packages")
    built = {}
    dims = {"X": 9, "H": 7, "V": 20, "C": 3}
    for name in ("binary_treelstm", "treelstm", "lstm", "dagrnn", "treernn", "mvrnn"):
        built[name] = load_example(EXAMPLES / f"{name}.cell", dims, out)
    for name in ("quarter", "gated_max"):
        path = out / f"{name}.cell"
        path.write_text(INVENTED[name])
        built[name] = cortexc.load(path, out_dir=out)
    return built


#: (CORTEXC_CUDA_BLOCKS, CORTEXC_CUDA_WEIGHTS): the emulated device has 4 SMs, so by default 4 blocks
#: own ceil(P / 4) units each (the last fewer); one block owns them all; 3 blocks leave a ragged last one
SETTINGS = [(None, None), ("1", None), ("3", "global"), ("2", None)]


def _emulate_against_the_interpreter(module, rng, monkeypatch, **environment: str | None):
    """Set (or, for None, unset) the environment, run the emulated forward of a random forest against the
    interpreter; the emulated model, the forest and the node kernel's period."""
    for variable, value in environment.items():
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    emulated, reference = twin_models(module, "cuda-emu", 3, rng)
    forest = small_forest(reference.cell, rng, 10, 24, chains=(9, 3, 1))
    inputs = random_inputs(reference.cell, forest, rng)
    got, expected = emulated(forest, **inputs), reference(forest, **inputs)
    for key, value in expected.items():
        assert relative_error(got[key], value) < 1e-5, key
    period = split_columns(schedule(reference.cell)).kernel("node").split.period
    return emulated, forest, period


@pytest.mark.slow
@pytest.mark.parametrize("blocks, weights", SETTINGS)
@pytest.mark.parametrize(
    "name", ["binary_treelstm", "treelstm", "lstm", "dagrnn", "treernn", "mvrnn", "quarter", "gated_max"]
)
def test_split_mode_matches_the_interpreter(split_packages, name, blocks, weights, rng, monkeypatch):
    emulated, _, period = _emulate_against_the_interpreter(
        split_packages[name],
        rng,
        monkeypatch,
        CORTEXC_CUDA_MODE="split",
        CORTEXC_CUDA_BLOCKS=blocks,
        CORTEXC_CUDA_WEIGHTS=weights,
    )
    grid, units, slice_bytes = _last_plan(emulated)
    owners = min(int(blocks or 4), period)
    assert units == -(-period // owners)
    assert grid >= -(-period // units)
    assert (slice_bytes > 0) == (weights is None)
    assert emulated._executor_for_device().lib.cx_last_launch_count() == 1


def test_split_mode_is_off_where_asked(split_packages, rng, monkeypatch):
    module = split_packages["binary_treelstm"]
    model = module.BinaryTreeLSTM(device="cuda-emu", seed=1)
    forest = Forest.random(3, rng=rng, binary=True, max_nodes=9)
    inputs = random_inputs(model.cell, forest, rng)
    monkeypatch.setenv("CORTEXC_CUDA_MODE", "persistent")
    model(forest, **inputs)
    assert _last_plan(model)[1] == 0
    monkeypatch.setenv("CORTEXC_CUDA_MODE", "levels")
    model(forest, **inputs)
    assert _last_plan(model)[0] == 0
    monkeypatch.delenv("CORTEXC_CUDA_MODE")
    model(forest, **inputs)
    assert _last_plan(model)[1] > 0  # the default where the cell splits


@pytest.mark.slow
@pytest.mark.parametrize("blocks", ["1", "4"])
@pytest.mark.parametrize(
    "name, dims", [("treelstm", {"X": 40, "H": 70}), ("binary_treelstm", {"X": 40, "H": 70, "V": 30, "C": 5})]
)
def test_split_mode_at_sizes_that_span_several_chunks_and_passes(name, dims, blocks, rng, tmp_path, monkeypatch):
    """K > 32 (several shared-memory chunks of the rows); with one block, more owned columns than threads
    (several column passes, no K split); with four, 18 units per block and the K range split."""
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CORTEXC_CUDA_MODE", "split")
    monkeypatch.setenv("CORTEXC_CUDA_BLOCKS", blocks)
    module = cortexc.load(EXAMPLES / f"{name}.cell", out_dir=tmp_path, **dims)
    cls = getattr(module, module.__all__[0])
    emulated, reference = cls(device="cuda-emu", seed=6), cls(device="interp", seed=6)
    forest = small_forest(reference.cell, rng, 10, 24, chains=(9, 3, 1))
    inputs = random_inputs(reference.cell, forest, rng)
    got, expected = emulated(forest, **inputs), reference(forest, **inputs)
    for key, value in expected.items():
        assert relative_error(got[key], value) < 1e-5, key
    assert _last_plan(emulated)[1] == 70 // int(blocks) + (70 % int(blocks) > 0)


@pytest.mark.slow
def test_the_plan_falls_back_when_shared_memory_is_short(rng, tmp_path, monkeypatch):
    """The emulated device has 227 KiB of shared memory per block (opt-in), as an H100/H200: a block
    owning all 100 units of a binary Tree-LSTM at H = 100 cannot hold their 400 KB of weights (they stay
    in global memory, the split goes on); four blocks of 25 units can. A TreeRNN at H = 1700 cannot even
    stage 16 rows of its 3400-wide GEMM operand: no split, rows only."""
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CORTEXC_CUDA_MODE", "split")
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", out_dir=tmp_path, X=8, H=100, V=10, C=2)
    emulated, reference = module.BinaryTreeLSTM(device="cuda-emu"), module.BinaryTreeLSTM(device="interp")
    forest = Forest.random(2, rng=rng, binary=True, max_nodes=7)
    inputs = random_inputs(reference.cell, forest, rng)
    expected = reference(forest, **inputs)
    for blocks, units, in_shared in (("1", 100, False), ("4", 25, True)):
        monkeypatch.setenv("CORTEXC_CUDA_BLOCKS", blocks)
        got = emulated(forest, **inputs)
        assert relative_error(got["h"], expected["h"]) < 1e-5
        _, planned_units, slice_bytes = _last_plan(emulated)
        assert planned_units == units and (slice_bytes > 0) == in_shared
        if in_shared:
            # 25 units x (5 node gates x K = 2H + 3 leaf gates x K = X) floats
            assert slice_bytes == 25 * (5 * 200 + 3 * 8) * 4

    monkeypatch.delenv("CORTEXC_CUDA_BLOCKS")
    wide = cortexc.load(EXAMPLES / "treernn.cell", out_dir=tmp_path, X=4, H=1700)
    emulated, reference = wide.TreeRNN(device="cuda-emu"), wide.TreeRNN(device="interp")
    forest = Forest.from_parents([2, 2, -1])
    inputs = random_inputs(reference.cell, forest, rng)
    got, expected = emulated(forest, **inputs), reference(forest, **inputs)
    assert relative_error(got["h"], expected["h"]) < 1e-5
    grid, units, _ = _last_plan(emulated)
    assert grid > 0 and units == 0


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [None, "3"])
@pytest.mark.parametrize("name", ["binary_treelstm", "treelstm", "lstm", "dagrnn", "mvrnn", "quarter"])
def test_per_level_mode_splits_small_levels_too(split_packages, name, blocks, rng, monkeypatch):
    """Without a cooperative launch (CORTEXC_CUDA_MODE=levels) a level with fewer tiles than SMs is one
    grid of column-owning blocks (weights from global memory), larger ones one grid of row tiles."""
    emulated, forest, period = _emulate_against_the_interpreter(
        split_packages[name], rng, monkeypatch, CORTEXC_CUDA_MODE="levels", CORTEXC_CUDA_BLOCKS=blocks
    )
    grid, units, _ = _last_plan(emulated)
    assert grid == 0 and units == -(-period // min(int(blocks or 4), period))
    assert emulated._executor_for_device().lib.cx_last_launch_count() >= forest.num_levels
