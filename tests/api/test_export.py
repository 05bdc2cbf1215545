"""`cortexc export`: the C library, the `_run` programs and the Makefile against the Python runtime.

The exported `_run` runs on random trees, chains, DAGs and SST trees and must agree with `device="cpu"`
and the interpreter; bad forests, inputs and files must give exit status 1 and the one line the Python
runtime's message gives (with and without AddressSanitizer/UBSan); `make test` (expected outputs,
threads, sanitizers) must pass in the exported directory.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.cli import main
from cortexc.errors import CortexcError, InputError
from cortexc.export import export
from cortexc.runtime import safetensors
from cortexc.runtime.validate import check_forest, check_inputs
from tests.helpers import EXAMPLES, REPO, random_inputs, relative_error, small_forest, sst_path
from tests.language.test_gate_by_gate import CELLS as GATE_CELLS
from tests.language.test_gate_by_gate import gate_forest

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None, reason="needs make, gcc")

#: the example, its cell and the dims used here (small, so that the interpreter is quick)
EXAMPLE_DIMS = {
    "treernn": {"H": 16},
    "lstm": {"H": 12, "X": 7},
    "dagrnn": {},
    "treelstm": {},
    "mvrnn": {},
    "attn_treelstm": {"X": 16, "H": 8},
    "treelstm_dropout": {"V": 50, "X": 8, "H": 6, "C": 3},
}


def _make(directory: Path, *targets: str) -> None:
    result = subprocess.run(["make", "-s", "-C", str(directory), *targets], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


class Exported:
    """An exported example with its `_run` and `_check` built, and the same cell in Python."""

    def __init__(
        self,
        root: Path,
        example: str,
        dims: dict[str, int],
        params: dict[str, np.ndarray] | None = None,
        path: Path | None = None,
        cell: int = 0,
    ):
        path = path or EXAMPLES / f"{example}.cell"
        module = cortexc.load(path, root / "py", **dims)
        self.cls = getattr(module, module.__all__[cell])  # the file's cell number `cell`
        self.name = self.cls.signature.name
        params_file = None
        if params is not None:
            model = self.cls(device="interp")
            model.load_params(params)
            params_file = root / "trained.safetensors"
            model.save_params(params_file)
        self.dir = export(path, root / "dist", dims, params_file)
        _make(self.dir, f"{self.name}_run", f"{self.name}_check")
        self.params = safetensors.load(self.dir / "params.safetensors")

    def model(self, device: str):
        model = self.cls(device=device)
        model.load_params(self.params)
        return model

    def run(self, tensors: dict[str, np.ndarray], program: str = "_run", params: Path | None = None):
        inputs, outputs = self.dir / "test" / "case.safetensors", self.dir / "test" / "case.out.safetensors"
        safetensors.save(inputs, tensors)
        outputs.unlink(missing_ok=True)
        command = [str(self.dir / f"{self.name}{program}"), str(params or self.dir / "params.safetensors")]
        result = subprocess.run([*command, str(inputs), str(outputs)], capture_output=True, text=True, cwd="/")
        return result, (safetensors.load(outputs) if result.returncode == 0 else None)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Exported examples, built once per module (with jittered params, passed as `--params`)."""
    cache: dict[str, Exported] = {}

    def get(example: str) -> Exported:
        if example not in cache:
            root = tmp_path_factory.mktemp(example)
            module = cortexc.load(EXAMPLES / f"{example}.cell", root / "seed", **EXAMPLE_DIMS[example])
            cls = getattr(module, module.__all__[0])
            jitter = np.random.default_rng(7)
            params = {
                k: (v + 0.1 * jitter.standard_normal(v.shape)).astype(np.float32)
                for k, v in cls(device="interp").params.items()
            }
            cache[example] = Exported(root, example, EXAMPLE_DIMS[example], params)
        return cache[example]

    return get


def _forest_tensors(forest: Forest, as_csr: bool) -> dict[str, np.ndarray]:
    if as_csr or not forest.is_tree:
        return {"children_ptr": forest.child_ptr.astype(np.int32), "children": forest.child_idx.astype(np.int32)}
    return {"parents": forest.parents.astype(np.int32)}


def _compare(
    exp: Exported, forest: Forest, inputs: dict[str, np.ndarray], as_csr: bool = False, interp_rtol: float = 1e-5
) -> None:
    """`_run` against device="cpu" (the same kernels) and the interpreter (an independent reference)."""
    result, got = exp.run({**_forest_tensors(forest, as_csr), **inputs})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for device in ("cpu", "interp"):
        expected = exp.model(device)(forest, **inputs)
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert got[name].shape == value.shape, name
            rtol = interp_rtol if device == "interp" else 1e-5
            assert relative_error(got[name], value) < rtol, f"{name} vs device={device}"


# ---------------------------------------------------------------- the Python side of safetensors


def test_safetensors_round_trip_and_malformed_files(tmp_path, rng):
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b.c": rng.integers(-5, 5, 7).astype(np.int32),
        "d": rng.standard_normal(()).astype(np.float64),
        "e": np.zeros((0, 4), np.int64),
    }
    path = tmp_path / "t.safetensors"
    safetensors.save(path, tensors)
    data = path.read_bytes()
    header = int.from_bytes(data[:8], "little")
    assert (8 + header) % 8 == 0  # the data starts aligned, as the reference writer does
    back = safetensors.load(path)
    assert list(back) == list(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value)
    for bad in (data[:5], data[: 8 + header // 2], data[:-4], b"\x04\0\0\0\0\0\0\0{x:}"):
        path.write_bytes(bad)
        with pytest.raises(InputError, match="t.safetensors"):
            safetensors.load(path)


def test_save_and_load_params_as_safetensors(tmp_path, rng):
    module = cortexc.load(EXAMPLES / "treernn.cell", tmp_path / "py", H=8)
    model = module.TreeRNN(device="interp", seed=3)
    model.save_params(tmp_path / "w.safetensors")
    other = module.TreeRNN(device="interp", seed=4)
    assert not np.array_equal(other.params["W"], model.params["W"])
    other.load_params(tmp_path / "w.safetensors")
    for name, value in model.params.items():
        assert np.array_equal(other.params[name], value)
    safetensors.save(tmp_path / "bad.safetensors", {"W": np.zeros((3, 3), np.float32)})
    with pytest.raises(InputError, match="param W must have shape"):
        other.load_params(tmp_path / "bad.safetensors")


def test_export_refuses_bad_params_and_writes_nothing(tmp_path, capsys):
    safetensors.save(tmp_path / "p.safetensors", {"W": np.zeros((2, 2), np.float32)})
    status = main(
        [
            "export",
            str(EXAMPLES / "treernn.cell"),
            "-o",
            str(tmp_path / "out"),
            "--params",
            str(tmp_path / "p.safetensors"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 1 and len(err.strip().splitlines()) == 1 and "W" in err
    assert not (tmp_path / "out" / "treernn").exists()


# ---------------------------------------------------------------- _run against the Python runtime


@pytest.mark.slow
def test_run_matches_python_on_random_trees(exported, rng):
    exp = exported("treernn")
    for trees in (1, 7, 40):
        forest = small_forest(exp.cls.signature, rng, trees=trees, max_nodes=25)
        _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng), as_csr=bool(trees % 2))
    saturated = Forest.random(5, rng=rng, binary=True)
    inputs = {"x": np.where(rng.random((saturated.num_nodes, 64)) < 0.5, -100.0, 100.0).astype(np.float32)}
    if "x" not in {i.name for i in exp.cls.signature.inputs}:
        pytest.fail("treernn's input is expected to be x")
    _compare(exp, saturated, inputs, interp_rtol=1e-4)  # fast-math tanh near +-1 (as device="cpu" has it)


@pytest.mark.slow
def test_an_exported_cell_with_dropout_runs_in_evaluation_mode(exported, rng):
    """The exported library serves: its dropout calls are the identity (cx_call's train flag is 0)."""
    exp = exported("treelstm_dropout")
    lines = sst_path("dev").read_text(encoding="utf-8").splitlines()[:20]
    for forest in (Forest.from_ptb(lines), Forest.random(6, rng=rng, binary=True, max_nodes=21)):
        inputs = random_inputs(exp.cls.signature, forest, rng)
        _compare(exp, forest, inputs)
        result, got = exp.run({**_forest_tensors(forest, False), **inputs})
        trained = exp.model("cpu")(forest, train=True, dropout_seed=5, **inputs)
        assert relative_error(got["logits"], trained["logits"]) > 1e-3  # training mode would differ


@pytest.mark.slow
def test_run_matches_python_on_chains(exported, rng):
    exp = exported("lstm")
    lengths = rng.integers(1, 30, 6)
    forest = Forest.concat([Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)]) for n in lengths])
    _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


def test_run_matches_python_on_wide_chains(exported, rng):
    """Levels of 8 rows: the exported library, like the Python runtime, runs the direct node kernel, whose
    weight is its params side by side (`passes.direct`), packed by the export's own loader."""
    exp = exported("lstm")
    lengths = rng.integers(20, 30, 8)
    forest = Forest.concat([Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)]) for n in lengths])
    assert any(max(w.blocks) > 1 for w in exp.cls._spec.target("c").packed)
    _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


@pytest.mark.parametrize("stem", ["gate_lstm", "gate_highway"])
def test_run_matches_python_with_block_weights(stem, tmp_path, rng):
    """Cells written gate by gate: their direct node kernel's weight is block rows of params side by side
    (the highway cell's last row a plain param over an equal concat), packed by the export's own loader."""
    path = tmp_path / f"{stem}.cell"
    path.write_text(GATE_CELLS[stem], encoding="utf-8")
    exp = Exported(tmp_path, stem, {}, path=path)
    assert any(len(w.blocks) > 1 and max(w.blocks) > 1 for w in exp.cls._spec.target("c").packed)
    forest = gate_forest(GATE_CELLS[stem], rng)
    _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


@pytest.mark.slow
def test_run_matches_python_on_dags(exported, rng):
    exp = exported("dagrnn")
    for nodes in (1, 12, 80):
        forest = Forest.random_dag(nodes, rng=rng)
        _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


@pytest.fixture(scope="module")
def exported_graph(tmp_path_factory):
    """A graph cell (examples/graphs/ggnn_distance.cell, 3 steps) exported: its steps unrolled in C."""
    path = EXAMPLES / "graphs" / "ggnn_distance.cell"
    return Exported(tmp_path_factory.mktemp("graph"), "ggnn_distance", {"H": 8, "T": 3}, path=path)


def test_run_matches_python_on_graphs_with_cycles(exported_graph, rng):
    """The exported C unrolls a graph cell's steps (double-buffered, as runtime/graph.py for an inference):
    on graphs with cycles, self-loops, repeated edges and isolated nodes it agrees with device="cpu" and
    the interpreter; states after the last step and outputs per node."""
    from tests.helpers import random_graph

    for nodes in (4, 9, 40):
        graph = random_graph(nodes, nodes, rng)
        assert graph.cycle is not None
        _compare(exported_graph, graph, random_inputs(exported_graph.cls.signature, graph, rng), as_csr=True)
    chain = Forest.from_parents([-1, 0, 1])  # a tree is a graph too (given as parents)
    _compare(exported_graph, chain, random_inputs(exported_graph.cls.signature, chain, rng))


def test_run_matches_python_with_edge_inputs(tmp_path, rng):
    """Edge inputs (an index `rel` choosing a matrix per edge, a float `w` per edge) given in the forest's edge
    order: the exported C puts them in its kernels' order, on shuffled-id DAGs (CSR) and trees (parents), and
    on a graph cell (the GGNN of examples/ggnn.cell, each edge read once per step)."""
    from tests.helpers import random_graph, shuffled_ids
    from tests.language.test_edge_inputs import TYPED_DAG

    path = tmp_path / "typed.cell"
    path.write_text(TYPED_DAG, encoding="utf-8")
    typed = Exported(tmp_path / "typed", "typed", {}, path=path)
    for nodes in (1, 15, 60):
        forest = shuffled_ids(Forest.random_dag(nodes, rng=rng, max_children=3, max_parents=3), rng)
        _compare(typed, forest, random_inputs(typed.cls.signature, forest, rng))
    tree = Forest.random(4, rng=rng, max_children=3, max_nodes=10)
    _compare(typed, tree, random_inputs(typed.cls.signature, tree, rng))
    ggnn = Exported(tmp_path / "ggnn", "ggnn", {"X": 4, "H": 6, "T": 3})
    for nodes in (4, 30):
        graph = random_graph(nodes, nodes, rng)
        _compare(ggnn, graph, random_inputs(ggnn.cls.signature, graph, rng), as_csr=True)
    bad = random_inputs(ggnn.cls.signature, graph, rng)
    bad["rel"][5] = 3
    result, _ = ggnn.run({**_forest_tensors(graph, True), **bad})
    edge = f"edge 5 (node {int(graph.edge_child[5])} -> node {int(graph.edge_parent[5])})"
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"GGNN_run: input rel: {edge} has index 3"), result.stderr


@pytest.mark.slow
def test_make_test_passes_for_an_exported_graph_cell(exported_graph):
    result = subprocess.run(["make", "-s", "-C", str(exported_graph.dir), "test"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all passed" in result.stdout and "FAIL" not in result.stdout


@pytest.mark.slow
def test_run_matches_python_on_child_sum_trees_and_mvrnn(exported, rng):
    for example in ("treelstm", "mvrnn"):
        exp = exported(example)
        forest = small_forest(exp.cls.signature, rng, trees=9, max_nodes=20)
        _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


@pytest.mark.slow
def test_run_matches_python_on_the_attentive_treelstm(exported, rng):
    """child_softmax in an exported library: trees of up to 5 children, leaves and one-child chains."""
    exp = exported("attn_treelstm")
    forest = Forest.concat([small_forest(exp.cls.signature, rng, trees=9, max_nodes=20), Forest.from_parents([1, -1])])
    _compare(exp, forest, random_inputs(exp.cls.signature, forest, rng))


@pytest.mark.slow
def test_run_matches_python_on_sst_trees(tmp_path, rng):
    path = sst_path("dev")
    with open(path, encoding="utf-8") as lines:
        forest = Forest.from_ptb(list(itertools.islice(lines, 12)))
    from cortexc.runtime.vocab import Vocab

    exp = Exported(tmp_path, "binary_treelstm", {})
    ids = Vocab.build([forest]).encode(forest).astype(np.int32)
    _compare(exp, forest, {"word": ids})
    _compare(exp, forest, {"word": ids}, as_csr=True)


@pytest.mark.slow
def test_run_on_an_empty_forest(exported):
    exp = exported("treernn")
    result, got = exp.run({"parents": np.zeros(0, np.int32), "x": np.zeros((0, 64), np.float32)})
    assert result.returncode == 0, result.stderr
    assert got["h"].shape == (0, 16)


# ---------------------------------------------------------------- bad input


def _python_message(cell, build, inputs) -> str:
    try:
        forest = build()
        check_forest(cell, forest)
        check_inputs(cell, forest, inputs)
    except CortexcError as err:
        return str(err)
    raise AssertionError("the Python runtime accepts this case")


def _bad_forests(rng, n: int):
    """(name, tensors, how the Python runtime builds the same forest) for bad forests of n nodes."""
    parents = Forest.random(3, rng=rng, binary=True, min_nodes=n, max_nodes=n).parents.astype(np.int32)
    m = parents.size
    cases = []
    bad = parents.copy()
    bad[int(rng.integers(0, m))] = m + 3
    cases.append(("parent out of range", {"parents": bad}, lambda b=bad: Forest.from_parents(b)))
    own = parents.copy()
    k = int(rng.integers(0, m))
    own[k] = k
    cases.append(("own parent", {"parents": own}, lambda b=own: Forest.from_parents(b)))
    forest = Forest.from_parents(parents)
    ptr, idx = forest.child_ptr.copy(), forest.child_idx.copy()
    cyc = idx.copy()
    root = int(forest.roots[0])
    # a node below the first root (post-order: its descendants come first) now reads that root: a cycle
    cyc[int(rng.integers(0, ptr[root]))] = root
    cases.append(("cycle", {"children_ptr": ptr, "children": cyc}, lambda c=cyc: Forest(ptr, c)))
    shared = idx.copy()
    shared[1] = shared[0]  # the first internal node reads its first child twice
    far = np.where(idx == idx[0], m, idx)
    cases.append(("child range", {"children_ptr": ptr, "children": far}, lambda: Forest(ptr, far)))
    cases.append(("two parents", {"children_ptr": ptr, "children": shared}, lambda: Forest(ptr, shared)))
    wide = np.concatenate([[-1], np.zeros(m - 1, np.int64)])
    cases.append(("arity", {"parents": wide}, lambda: Forest.from_parents(wide)))
    return [(name, {k: np.asarray(v, np.int32) for k, v in t.items()}, b) for name, t, b in cases]


@pytest.mark.slow
@pytest.mark.parametrize("program", ["_run", "_run_asan"])
def test_bad_forests_and_inputs_give_the_python_message(exported, rng, program):
    exp = exported("treernn")
    if program == "_run_asan":
        _make(exp.dir, f"{exp.name}_run_asan")
    sig = exp.cls.signature
    for name, tensors, build in _bad_forests(rng, int(rng.integers(5, 15)) * 2 + 1):
        n = tensors["parents"].size if "parents" in tensors else tensors["children_ptr"].size - 1
        inputs = random_inputs(sig, Forest.from_parents(-np.ones(n, np.int64)), rng)
        result, _ = exp.run({**tensors, **inputs}, program)
        assert result.returncode == 1, name
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (name, result.stderr)
        assert lines[0] == f"{exp.name}_run: {_python_message(sig, build, inputs)}", name
    forest = Forest.random(3, rng=rng, binary=True)
    good = {"parents": forest.parents.astype(np.int32), **random_inputs(sig, forest, rng)}
    n = forest.num_nodes
    wrong = [
        ({**good, "x": good["x"][:-1]}, f"input x must have shape ({n}, 64) (one row per node), got ({n - 1}, 64)"),
        ({**good, "x": good["x"].astype(np.float64)}, "input x must be float32 (F32), got F64"),
        ({**good, "parents": good["parents"].astype(np.int64)}, "INPUTS: parents must be a 1-D int32 (I32) tensor"),
        ({k: v for k, v in good.items() if k != "x"}, "missing input 'x' for cell TreeRNN"),
        ({**good, "y": good["x"]}, "cell TreeRNN has no input 'y' (its inputs: x)"),
        ({"x": good["x"]}, "INPUTS holds no forest"),
    ]
    for tensors, message in wrong:
        result, _ = exp.run(tensors, program)
        assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"{exp.name}_run: {message}"), result.stderr
    # files: a truncated INPUTS, a header that is not JSON, missing PARAMS, wrong params, unwritable OUTPUTS
    case = exp.dir / "test" / "case.safetensors"
    safetensors.save(case, good)
    files = exp.dir / "test"
    (files / "cut.safetensors").write_bytes(case.read_bytes()[:-3])
    (files / "junk.safetensors").write_bytes(b'\x10\0\0\0\0\0\0\0{"a": [1, 2}    ')
    safetensors.save(files / "wrong.safetensors", {"W": np.zeros((3, 3), np.float32)})
    (files / "o.safetensors").unlink(missing_ok=True)
    binary = str(exp.dir / f"{exp.name}{program}")
    params = str(exp.dir / "params.safetensors")
    for arguments in (
        [params, str(files / "cut.safetensors"), str(files / "o.safetensors")],
        [params, str(files / "junk.safetensors"), str(files / "o.safetensors")],
        [str(files / "none.safetensors"), str(case), str(files / "o.safetensors")],
        [str(files / "wrong.safetensors"), str(case), str(files / "o.safetensors")],
        [params, str(case), str(files / "no" / "dir" / "o.safetensors")],
        [params, str(case)],
    ):
        result = subprocess.run([binary, *arguments], capture_output=True, text=True)
        assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, (arguments, result.stderr)
        assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr
    assert not (files / "o.safetensors").exists()
    # damaged INPUTS files (bytes of the header and data flipped, cut anywhere): exit 0 or 1, never a crash
    data = case.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    for trial in range(12):
        damaged = bytearray(data)
        if trial % 3 == 2:
            damaged = damaged[: int(rng.integers(0, len(data)))]
        else:
            for at in rng.integers(0, header if trial % 3 == 0 else len(data), 4):
                damaged[int(at)] = int(rng.integers(0, 256))
        (files / "damaged.safetensors").write_bytes(bytes(damaged))
        result = subprocess.run(
            [binary, params, str(files / "damaged.safetensors"), str(files / "fuzz.out.safetensors")],
            capture_output=True,
            text=True,
            errors="replace",  # a damaged tensor name is echoed as the file has it
        )
        assert result.returncode in (0, 1), result.stderr
        assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr
        assert result.returncode == 0 or result.stderr.count("\n") == 1, result.stderr


@pytest.mark.slow
def test_dag_cell_accepts_shared_children_and_refuses_cycles(exported, rng):
    exp = exported("dagrnn")
    sig = exp.cls.signature
    forest = Forest.random_dag(40, rng=rng)
    assert not forest.is_tree
    inputs = random_inputs(sig, forest, rng)
    _compare(exp, forest, inputs)
    # a child of some edge now also reads that edge's owner: a cycle of two
    edge = int(rng.integers(0, forest.child_idx.size))
    owner = int(np.searchsorted(forest.child_ptr, edge, side="right") - 1)
    kids = [list(forest.children(i)) for i in range(forest.num_nodes)]
    kids[int(forest.child_idx[edge])].append(owner)
    ptr = np.cumsum([0] + [len(k) for k in kids]).astype(np.int64)
    idx = np.array([c for k in kids for c in k], np.int64)
    result, _ = exp.run({"children_ptr": ptr.astype(np.int32), "children": idx.astype(np.int32), **inputs})
    assert result.returncode == 1
    assert result.stderr.strip() == f"{exp.name}_run: {_python_message(sig, lambda: Forest(ptr, idx), inputs)}"
    assert result.stderr.startswith(f"{exp.name}_run: cycle through node")


# ---------------------------------------------------------------- make test, threads, several cells, C++


@pytest.mark.slow
@pytest.mark.parametrize("example", ["treernn", "dagrnn"])
def test_make_test_passes_in_the_exported_directory(tmp_path, example):
    defines = [f"-D{name}={value}" for name, value in EXAMPLE_DIMS[example].items()]
    assert main(["export", str(EXAMPLES / f"{example}.cell"), "-o", str(tmp_path), *defines]) == 0
    directory = tmp_path / example
    result = subprocess.run(["make", "-s", "-C", str(directory), "test"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all passed" in result.stdout and "FAIL" not in result.stdout
    assert "2 threads on one model" in result.stdout and "caller-owned arrays" in result.stdout
    assert result.stdout.count("_run_asan") >= 8  # the sanitized program ran on the good and bad cases


@pytest.mark.slow
def test_make_test_fails_on_wrong_expected_outputs(tmp_path):
    directory = export(EXAMPLES / "treernn.cell", tmp_path, {"H": 8})
    expected = directory / "test" / "TreeRNN.expected.safetensors"
    tensors = safetensors.load(expected)
    tensors["h"][3, 2] += 1e-3
    safetensors.save(expected, tensors)
    result = subprocess.run(["make", "-s", "-C", str(directory), "test"], capture_output=True, text=True)
    assert result.returncode != 0 and "FAIL: TreeRNN_run outputs" in result.stdout


@pytest.mark.slow
def test_threads_on_one_model(exported, rng):
    exp = exported("treelstm")
    forest = small_forest(exp.cls.signature, rng, trees=30, max_nodes=25)
    inputs = random_inputs(exp.cls.signature, forest, rng)
    expected = exp.model("cpu")(forest, **inputs)
    files = exp.dir / "test"
    safetensors.save(files / "t.inputs.safetensors", {**_forest_tensors(forest, False), **inputs})
    safetensors.save(files / "t.expected.safetensors", dict(expected))
    command = [str(exp.dir / f"{exp.name}_check"), "threads", str(exp.dir / "params.safetensors")]
    command += [str(files / "t.inputs.safetensors"), str(files / "t.expected.safetensors"), "4", "5"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    create = [str(exp.dir / f"{exp.name}_check"), "create", str(exp.dir / "params.safetensors")]
    create += [str(files / "t.inputs.safetensors"), str(files / "t.expected.safetensors")]
    result = subprocess.run(create, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # a model from caller-owned arrays, freed before the forward
    partial = dict(exp.params)
    dropped = sorted(partial)[0]
    del partial[dropped]
    safetensors.save(files / "partial.safetensors", partial)
    create[2] = str(files / "partial.safetensors")
    result = subprocess.run(create, capture_output=True, text=True)
    assert result.returncode == 1 and f"missing params for cell {exp.name}: {dropped}" in result.stderr
    wrong = dict(expected)
    wrong["c"] = wrong["c"] + 1.0
    safetensors.save(files / "t.expected.safetensors", wrong)
    assert subprocess.run(command, capture_output=True, text=True).returncode == 1


@pytest.mark.slow
def test_a_file_of_two_cells_links_into_one_library(tmp_path, rng):
    source = (EXAMPLES / "treernn.cell").read_text() + "\n" + (EXAMPLES / "dagrnn.cell").read_text()
    cell_file = tmp_path / "two.cell"
    cell_file.write_text(source)
    module = cortexc.load(cell_file, tmp_path / "py")
    params = {}
    for name in module.__all__:
        for key, value in getattr(module, name)(device="interp", seed=5).params.items():
            params[f"{name}.{key}"] = value
    safetensors.save(tmp_path / "p.safetensors", params)
    directory = export(cell_file, tmp_path / "dist", None, tmp_path / "p.safetensors")
    stored = safetensors.load(directory / "params.safetensors")
    assert set(stored) == set(params)
    result = subprocess.run(["make", "-s", "-C", str(directory), "test"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (directory / "libtwo.so").exists() and (directory / "libtwo.a").exists()
    # a file of one cell's params under plain names is accepted too
    plain = {k.partition(".")[2]: v for k, v in params.items() if k.startswith("TreeRNN.")}
    safetensors.save(tmp_path / "plain.safetensors", plain)
    inputs = directory / "test" / "TreeRNN.inputs.safetensors"
    out = tmp_path / "o.safetensors"
    run = subprocess.run([str(directory / "TreeRNN_run"), str(tmp_path / "plain.safetensors"), str(inputs), str(out)])
    assert run.returncode == 0


@pytest.mark.slow
def test_cpp_serving_example_classifies_trees(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    directory = export(EXAMPLES / "binary_treelstm.cell", tmp_path, {"V": 50, "X": 16, "H": 8})
    serve = REPO / "examples" / "serve"
    result = subprocess.run(
        ["make", "-s", "-C", str(serve), f"EXPORT={directory}", f"OUT={tmp_path}"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    program = tmp_path / "classify"
    # two trees: ((0 1) 2) and (3 4), as parent arrays with word ids at the leaves
    lines = "4 4 3 -1 3 : 1 2 7 0 0\n-1 0 0 : 0 5 9\n"
    run = subprocess.run(
        [str(program), str(directory / "params.safetensors")], input=lines, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", tmp_path / "py", V=50, X=16, H=8)
    model = module.BinaryTreeLSTM(device="interp")
    model.load_params(directory / "params.safetensors")
    labels = []
    for line in lines.splitlines():
        parents, words = (np.array(part.split(), np.int64) for part in line.split(":"))
        forest = Forest.from_parents(parents)
        logits = model(forest, word=words.astype(np.int32))["logits"]
        labels.append(int(np.argmax(logits[forest.roots[0]])))
    assert [int(line.split()[-1]) for line in run.stdout.splitlines()] == labels
    bad = subprocess.run(
        [str(program), str(directory / "params.safetensors")], input="0 : 1\n", capture_output=True, text=True
    )
    assert bad.returncode == 1 and "node 0 is its own parent" in bad.stderr
