"""`torch.export` of models holding a `CellModule` (../shared/spec/torch.md, "Deployment: `torch.export`").

Three cells, each inside a small model with a `Linear` head on the cell's h: the child-sum Tree-LSTM (a
float input), the binary Tree-LSTM (an index input, an output) and the DAG-RNN (shared children). Each is
exported with every forest size dynamic and compared with the eager model on forests of other sizes;
saved and loaded in a fresh process, which finds the package by the ops' key in the build cache; loaded
in a process whose build cache is empty (a typed error naming the key, then success once the `.cell` is
loaded); and exported again in that fresh process, which prints the same graph code. AOTInductor compiles
a program that runs in a fresh Python process, and the README's sample runs.
"""

from __future__ import annotations

import gc
import io
import json
import os
import re
import subprocess
import sys
import weakref
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cortexc  # noqa: E402
from cortexc import Forest  # noqa: E402
from cortexc.errors import CortexcError, OutputError  # noqa: E402
from cortexc.torch import CellModule, ForestBatch, cell_forward, cell_key  # noqa: E402
from tests.helpers import EXAMPLES, REPO, relative_error  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A cell of examples/ at small dims, the input the model feeds it, and how its forests look."""

    file: str
    cell: str
    dims: dict[str, int]
    input: str
    forests: str  # "trees", "binary" or "dag"


CASES = {
    "childsum": Case("treelstm.cell", "ChildSumTreeLSTM", {"X": 6, "H": 5}, "x", "trees"),
    "binary": Case("binary_treelstm.cell", "BinaryTreeLSTM", {"V": 40, "X": 6, "H": 5, "C": 3}, "word", "binary"),
    "dagrnn": Case("dagrnn.cell", "DagRNN", {"X": 6, "H": 5}, "x", "dag"),
}
HEAD = 3


def cell_class(name: str):
    case = CASES[name]
    return getattr(cortexc.load(EXAMPLES / case.file, **case.dims), case.cell)


class Net(torch.nn.Module):
    """A cell and a Linear head on its h: what a user exports."""

    def __init__(self, name: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.input = CASES[name].input
        self.cell = CellModule(cell_class(name), seed=seed)
        self.head = torch.nn.Linear(CASES[name].dims["H"], HEAD)

    def forward(self, batch: ForestBatch, value: torch.Tensor) -> torch.Tensor:
        return self.head(self.cell(batch, **{self.input: value})["h"])


def forest(name: str, rng: np.random.Generator, size: int) -> Forest:
    kind = CASES[name].forests
    if kind == "dag":
        return Forest.random_dag(size * 3, rng=rng)
    return Forest.random(size, rng=rng, binary=kind == "binary", max_children=2 if kind == "binary" else 3, max_nodes=9)


def value(name: str, forest: Forest, rng: np.random.Generator) -> torch.Tensor:
    """The model's input for `forest`: word ids, or float rows."""
    case = CASES[name]
    if case.input == "word":
        return torch.as_tensor(rng.integers(0, case.dims["V"], forest.num_nodes))
    return torch.from_numpy(rng.standard_normal((forest.num_nodes, case.dims["X"])).astype(np.float32))


def example(name: str) -> tuple[ForestBatch, torch.Tensor]:
    """The forest a model is exported with (the same in every process): at least 2 of every count, since
    torch specialises a size of 0 or 1 in the example (`ForestBatch.dynamic_shapes`)."""
    rng = np.random.default_rng(37)
    while True:
        candidate = forest(name, rng, 4)
        batch = ForestBatch.from_forest(candidate)
        if min(t.shape[0] for t in batch.leaves()) >= 2 and batch.level_ptr.shape[0] >= 3:
            return batch, value(name, candidate, rng)


def export(net: Net, name: str) -> torch.export.ExportedProgram:
    nodes = torch.export.Dim("nodes")
    shapes = (ForestBatch.dynamic_shapes(nodes), {0: nodes})
    return torch.export.export(net, example(name), dynamic_shapes=shapes)


def others(name: str, rng: np.random.Generator) -> list[tuple[ForestBatch, torch.Tensor]]:
    """Forests of other sizes: bigger, and small ones with a count of 1 (one root, one level or one leaf)."""
    small = [Forest.from_parents([-1]), Forest.from_parents([-1, 0]), Forest.from_parents([2, 2, -1])]
    forests = [forest(name, rng, 7), *small]  # trees are DAGs too
    return [(ForestBatch.from_forest(f), value(name, f, rng)) for f in forests]


# ------------------------------------------------------------------------------------------------ in process
@pytest.mark.parametrize("name", list(CASES))
def test_the_exported_model_equals_eager_on_forests_of_other_sizes(name, rng):
    net = Net(name)
    program = export(net, name)
    key = cell_key(cell_class(name), "cpu")
    code = program.graph_module.code
    assert f"torch.ops.cortexc.cell_forward.default('{key}'" in code  # the op names the package, by its key
    assert export(Net(name, seed=1), name).graph_module.code == code  # another module: no handle or id in it
    module = program.module()
    with torch.no_grad():
        for batch, given in [example(name), *others(name, rng)]:
            expected = net(batch, given)
            got = module(ForestBatch(*batch.leaves()), given)  # no Forest: the exported graph never reads it
            assert got.shape == expected.shape == (batch.num_nodes, HEAD)
            assert relative_error(got.numpy(), expected.numpy()) < 1e-5


def test_a_program_runs_after_its_module_is_gone(rng):
    """The ops name the package, not the module: a program recorded while its model lived runs once the model
    is collected, as does that program saved and loaded again here (tensors no module owns: the key's
    shared runner)."""
    from cortexc.torch.runner import _SHARED

    net = Net("binary")
    batch, given = others("binary", rng)[0]
    with torch.no_grad():
        expected = net(batch, given)
    program = export(net, "binary")
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    gone = weakref.ref(net.cell)
    del net
    gc.collect()
    assert gone() is None
    buffer.seek(0)
    with torch.no_grad():
        for module in (program.module(), torch.export.load(buffer).module()):
            assert relative_error(module(batch, given).numpy(), expected.numpy()) < 1e-5
    assert (cell_key(cell_class("binary"), "cpu"), None) in _SHARED


def test_a_string_that_is_not_a_key_is_a_typed_error():
    batch, _ = example("childsum")
    seed = torch.zeros((), dtype=torch.int64)
    with pytest.raises(CortexcError, match="is not a cortexc cell key"):
        cell_forward("5", [], [], *batch.tensors(), False, seed)
    unknown = "nowhere.Cell-0123456789abcdef@cpu"
    with pytest.raises(OutputError, match=f"no compiled cell for the key '{unknown}'.*cortexc.load the .cell"):
        cell_forward(unknown, [], [], *batch.tensors(), False, seed)


# ------------------------------------------------------------------------------------------------ other processes
#: run in a fresh process: load each saved program, run it (the package found by key), print the results
LOAD = """
import json, sys
import torch
import cortexc.torch
from cortexc.errors import CortexcError
from cortexc.torch import ForestBatch

folder, names, reload = sys.argv[1], sys.argv[2].split(","), sys.argv[3] == "1"
runs = torch.load(f"{folder}/runs.pt")
report = {}

def run(program, name):
    got = []
    for tensors, given in runs[name]["inputs"]:
        with torch.no_grad():
            got.append(program(ForestBatch(*tensors), given))
    return got

for name in names:
    program = torch.export.load(f"{folder}/{name}.pt2").module()
    entry = report[name] = {}
    if reload:  # an empty build cache: the call fails, then succeeds once the .cell is loaded here
        try:
            run(program, name)
        except Exception as err:  # what reaches the caller, as it is
            entry["error"] = [type(err).__name__, isinstance(err, CortexcError), str(err)]
        import cortexc

        cortexc.load(runs[name]["file"], **runs[name]["dims"])
    got = run(program, name)
    entry["errors"] = [float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, runs[name]["expected"])]
if not reload:  # export the same models again here: the graph code is the parent's
    from tests.api.test_torch_export import Net, export

    for name in names:
        report[name]["code"] = export(Net(name), name).graph_module.code
print(json.dumps(report))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each model exported and saved, with forests of other sizes, their inputs and the eager results."""
    folder = tmp_path_factory.mktemp("programs")
    rng = np.random.default_rng(5)
    runs, codes = {}, {}
    for name, case in CASES.items():
        net = Net(name)
        program = export(net, name)
        codes[name] = program.graph_module.code
        torch.export.save(program, folder / f"{name}.pt2")
        inputs = [(batch.leaves(), given) for batch, given in others(name, rng)[:2]]
        with torch.no_grad():
            expected = [net(ForestBatch(*tensors), given) for tensors, given in inputs]
        file = str(EXAMPLES / case.file)  # as `cell_class` loads it: the same path makes the same package
        key = cell_key(cell_class(name), "cpu")
        runs[name] = {"inputs": inputs, "expected": expected, "file": file, "dims": case.dims, "key": key}
    torch.save(runs, folder / "runs.pt")
    return folder, runs, codes


def _load(folder, env: dict[str, str], reload: bool) -> dict:
    command = [sys.executable, "-c", LOAD, str(folder), ",".join(CASES), "1" if reload else "0"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_saved_program_loads_in_a_fresh_process_and_exports_the_same_graph(saved):
    """`torch.export.load` after ``import cortexc.torch`` only: the ops find each package by key in the build
    cache and give the parent's eager results on forests of other sizes; the same model exported there
    prints the same graph code."""
    folder, _, codes = saved
    report = _load(folder, _env(), reload=False)
    for name in CASES:
        assert max(report[name]["errors"]) < 1e-5, name
        assert report[name]["code"] == codes[name], name


@pytest.mark.slow  # builds the three packages again in the empty cache
def test_a_program_whose_package_is_not_in_the_build_cache_names_its_key_until_the_cell_is_loaded(saved, tmp_path):
    """An empty build cache: the call raises cortexc's `OutputError` itself (not a torch error), naming the
    key and saying to load the `.cell`; after `cortexc.load` of it in that process, the same call works."""
    folder, runs, _ = saved
    report = _load(folder, _env(CORTEXC_CACHE=str(tmp_path / "empty-cache")), reload=True)
    for name in CASES:
        kind, typed, message = report[name]["error"]
        assert kind == "OutputError" and typed, (name, kind)
        assert runs[name]["key"] in message and "cortexc.load the .cell" in message, message
        assert max(report[name]["errors"]) < 1e-5, name


@pytest.mark.slow
def test_aotinductor_compiles_a_program_that_runs_in_a_fresh_process(saved, tmp_path):
    """`aoti_compile_and_package`, then `aoti_load_package` in a process that imported `cortexc.torch`: the
    compiled graph calls the ops (Python kernels) through torch's dispatcher, on forests of other sizes."""
    folder, _, _ = saved
    package = torch._inductor.aoti_compile_and_package(
        torch.export.load(folder / "binary.pt2"), package_path=str(tmp_path / "binary-aoti.pt2")
    )
    script = (
        "import json, sys, torch\n"
        "from cortexc.torch import ForestBatch\n"
        "compiled = torch._inductor.aoti_load_package(sys.argv[1])\n"
        "runs = torch.load(sys.argv[2])['binary']\n"
        "got = [compiled(ForestBatch(*tensors), given) for tensors, given in runs['inputs']]\n"
        "print(json.dumps([float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, runs['expected'])]))\n"
    )
    command = [sys.executable, "-c", script, str(package), str(folder / "runs.pt")]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert max(json.loads(done.stdout.strip().splitlines()[-1])) < 1e-5


@pytest.mark.slow
def test_the_readme_sample_exports_and_runs_in_another_process(tmp_path, monkeypatch):
    """README.md's "Deploy with torch.export": its first block here (from a folder with examples/ in it),
    its second in a fresh process."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Deploy with torch.export\n", 1)[1].split("\n## ", 1)[0]
    export_block, load_block = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    (tmp_path / "examples").symlink_to(EXAMPLES)
    monkeypatch.chdir(tmp_path)
    exec(compile(export_block, "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "net.pt2").is_file()
    done = subprocess.run(
        [sys.executable, "-c", load_block], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"torch\.Size\(\[\d+, 3\]\)", done.stdout.strip()), done.stdout
