"""A generated package runs with the compiler out of reach.

The package carries everything the runtime reads (`cell.json`: signature,
ABI, schedule, kernel hashes), so a process where the compiler's modules
cannot even be imported still loads it, runs `device="cpu"` forward and
backward, and gets the interpreter's numbers (computed here, in a process
that has the compiler).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.options import KNOWN_TARGETS, CompileOptions
from cortexc.pipeline import write_package
from cortexc.runtime.loader import import_package
from tests.helpers import EXAMPLES, REPO, random_inputs, relative_error

#: what a running package must not need (the compiler and its libraries)
COMPILER_MODULES = (
    "cortexc.frontend",
    "cortexc.ir",
    "cortexc.passes",
    "cortexc.codegen",
    "cortexc.pipeline",
    "cortexc.options",
    "lark",
    "jinja2",
)

BLOCKED_RUN = textwrap.dedent(
    """
    import importlib.abc, json, pickle, sys
    import numpy as np

    BLOCKED = {blocked!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"{{name}} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocker())
    import cortexc
    from cortexc import Forest
    from cortexc.runtime.loader import import_package

    package = import_package(__import__("pathlib").Path({package!r}))
    model = getattr(package, package.__all__[0])(device="cpu", seed=0)
    data = np.load({inputs!r})
    with open({forest!r}, "rb") as file:
        forest = pickle.load(file)
    inputs = {{k: data[k] for k in data.files}}
    out = model(forest, grad=True, **inputs)
    grads = model.backward(out, {{"h": np.ones_like(out["h"])}})
    np.savez({result!r}, **{{"out_" + k: v for k, v in out.items()}}, **{{"grad_" + k: v for k, v in grads.items()}})
    loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
    print(json.dumps(loaded))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["treelstm.cell", "binary_treelstm.cell", "dagrnn.cell"])
def test_package_runs_cpu_with_the_compiler_blocked(example, tmp_path):
    path = EXAMPLES / example
    dims = {"X": 6, "H": 5, **({"V": 11, "C": 3} if example == "binary_treelstm.cell" else {})}
    options = CompileOptions.make(dims, targets=KNOWN_TARGETS)
    package_dir = write_package(path.read_text(), str(path), tmp_path / "pkg", options)
    module = import_package(package_dir)
    cls = getattr(module, module.__all__[0])
    reference = cls(device="interp", seed=0)
    rng = np.random.default_rng(7)
    if cls.signature.structure.shares_children:
        forest = Forest.random_dag(25, rng=rng)
    else:
        arity = cls.signature.arity
        forest = Forest.random(4, rng=rng, binary=arity == 2, max_children=arity or 3, max_nodes=12)
    inputs = random_inputs(cls.signature, forest, rng)
    expected = reference(forest, grad=True, **inputs)
    expected_grads = reference.backward(expected, {"h": np.ones_like(expected["h"])})
    np.savez(tmp_path / "inputs.npz", **inputs)
    with open(tmp_path / "forest.pickle", "wb") as file:
        pickle.dump(forest, file)
    script = BLOCKED_RUN.format(
        blocked=COMPILER_MODULES,
        package=str(package_dir),
        inputs=str(tmp_path / "inputs.npz"),
        forest=str(tmp_path / "forest.pickle"),
        result=str(tmp_path / "result.npz"),
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "CORTEXC_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    with np.load(tmp_path / "result.npz") as result:
        for name, value in expected.items():
            assert relative_error(result[f"out_{name}"], value) < 1e-5, name
        for name, value in expected_grads.items():
            assert relative_error(result[f"grad_{name}"], value) < 1e-5, name


def test_importing_cortexc_loads_no_compiler_module():
    script = "import sys, cortexc, cortexc.runtime.model; print(sorted(sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout)
    assert [m for m in loaded if any(m == b or m.startswith(b + ".") for b in COMPILER_MODULES)] == []
    assert "cortexc.ir.cell" not in loaded  # the runtime reads signatures, not the IR
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.") or m == "cortexc.torch"]  # an extra


def test_compile_functions_are_still_reachable_from_cortexc():
    cells = cortexc.compile_file(EXAMPLES / "treelstm.cell", {"X": 4, "H": 3})
    assert cells[0].name == "ChildSumTreeLSTM" and cells[0].grads is not None
    with pytest.raises(AttributeError):
        cortexc.no_such_thing  # noqa: B018
