"""`cortexc export` of `down` cells: the exported C turns the checked forest around (`cx_reverse`, as
`runtime/topdown.py`), computes `edge.position` / `edge.siblings` of the edge to each parent and puts edge
inputs in its kernels' order; `_run` must agree with `device="cpu"` and the interpreter on shuffled-id
trees (given as parents and as CSR), SST trees, single nodes, concatenations and DAGs; a family chosen by
`edge.position` refuses a node with more children than it has matrices, with the Python runtime's message;
`make test` passes in the exported directory; the bidirectional Tree-LSTM's two cells chain through files."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from cortexc import Forest
from cortexc.runtime import safetensors
from cortexc.runtime.validate import check_forest
from tests.api.test_export import Exported, _compare, _forest_tensors
from tests.helpers import random_inputs, relative_error, shuffled_ids, sst_path
from tests.language.test_down import DAG_DOWN, DAG_EDGES, DOWN_LSTM, POSITIONS

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None, reason="needs make, gcc")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The down cells of tests/language/test_down.py, exported with jittered params."""
    built = {}
    for name, text in (("positions", POSITIONS), ("dag", DAG_EDGES), ("lstm", DOWN_LSTM), ("dagdown", DAG_DOWN)):
        root = tmp_path_factory.mktemp(name)
        path = root / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        seed = Exported(root / "seed", name, {}, path=path)
        jitter = np.random.default_rng(11)
        params = {k: (v + 0.2 * jitter.standard_normal(v.shape)).astype(np.float32) for k, v in seed.params.items()}
        built[name] = Exported(root / "jittered", name, {}, params, path=path)
    return built


def _trees(rng) -> list[Forest]:
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    binary = shuffled_ids(Forest.random(6, rng=rng, binary=True, max_nodes=15), rng)
    start = int(rng.integers(0, 300))
    return [
        binary,
        Forest.from_parents([-1]),
        Forest.from_ptb(lines[start : start + 10]),
        Forest.concat([Forest.from_parents([-1]), binary, Forest.from_parents([2, 2, -1])]),
    ]


@pytest.mark.parametrize("name", ["positions", "lstm"])
def test_run_matches_python_on_down_trees(exported, name, rng):
    """Positions, siblings and an edge input (`positions`), outputs at the forest's roots (`lstm`); forests as
    parents and as CSR with shuffled child orders."""
    exp = exported[name]
    for forest in _trees(rng):
        inputs = random_inputs(exp.cls.signature, forest, rng)
        _compare(exp, forest, inputs)
        _compare(exp, forest, inputs, as_csr=True)
    wide = Forest.random(5, rng=rng, max_children=2, max_nodes=12)  # some nodes with one child
    if name == "lstm":
        wide = shuffled_ids(Forest.random(5, rng=rng, max_children=4, max_nodes=20), rng)
    _compare(exp, wide, random_inputs(exp.cls.signature, wide, rng), as_csr=True)


@pytest.mark.parametrize("name", ["dag", "dagdown"])
def test_run_matches_python_on_down_dags(exported, name, rng):
    """Per-parent reductions, typed edges, positions and siblings on DAGs with shared nodes and shuffled ids."""
    exp = exported[name]
    for nodes in (1, 12, 50):
        forest = shuffled_ids(Forest.random_dag(nodes, rng=rng, max_children=4, max_parents=3), rng)
        _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


def test_a_position_family_refuses_a_node_with_more_children(exported, rng):
    """P[edge.position] of the DAG cell holds 4 matrices: a node of 5 children is refused by `_run` with the
    Python runtime's message, nothing written."""
    exp = exported["dag"]
    wide = Forest.from_parents([5, 5, 5, 5, 5, -1])
    with pytest.raises(Exception) as python:
        check_forest(exp.cls.signature, wide)
    result, got = exp.run({**_forest_tensors(wide, True), **random_inputs(exp.cls.signature, wide, rng)})
    assert result.returncode == 1 and got is None
    assert result.stderr.strip() == f"{exp.name}_run: {python.value}"


@pytest.mark.slow
def test_make_test_passes_for_an_exported_down_cell(exported):
    directory = str(exported["positions"].dir)
    result = subprocess.run(["make", "-s", "-C", directory, "test"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all passed" in result.stdout and "FAIL" not in result.stdout


def test_the_bidirectional_tree_lstm_chains_through_its_exported_cells(tmp_path, rng):
    """examples/bitreelstm.cell exported whole (one library, prefixed params): the bottom-up cell's `h` from
    its `_run`, given as the down cell's input `hu`, gives the logits the NumPy API's chained cells give."""
    dims = {"V": 30, "X": 6, "H": 5, "C": 3}
    up = Exported(tmp_path / "up", "bitreelstm", dims, cell=0)
    down = Exported(tmp_path / "down", "bitreelstm", dims, cell=1)
    models = []
    for exp in (up, down):
        model = exp.cls(device="cpu")
        model.load_params({k.split(".", 1)[1]: v for k, v in exp.params.items() if k.startswith(f"{exp.name}.")})
        models.append(model)
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    forest = Forest.from_ptb(lines[:6])
    word = rng.integers(0, dims["V"], forest.num_nodes).astype(np.int32)
    result, got_up = up.run({**_forest_tensors(forest, False), "word": word})
    assert result.returncode == 0, result.stderr
    result, got_down = down.run({**_forest_tensors(forest, False), "word": word, "hu": got_up["h"]})
    assert result.returncode == 0, result.stderr
    expected_up = models[0](forest, word=word)
    expected = models[1](forest, word=word, hu=expected_up["h"])
    assert relative_error(got_up["h"], expected_up["h"]) < 1e-5
    for name in ("h", "c", "logits"):
        assert relative_error(got_down[name], expected[name]) < 1e-5, name
    saved = safetensors.load(down.dir / "params.safetensors")
    assert saved["BiTreeLSTMDown.U"].shape == (2, 4 * dims["H"], dims["H"])  # the 3-D family as it is
