"""Plain helpers shared by the test modules (fixtures and collection hooks stay in conftest.py).

Import them as ``from tests.helpers import ...``; ``tests.conftest`` re-exports
the older names so modules written against it keep working.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SST_DIR = Path(os.environ.get("CORTEXC_SST_DIR", REPO.parent / "shared" / "data" / "sst"))
#: every example cell file by a name unique among them: examples/*.cell by its stem, the SST table's
#: examples/sst/*.cell as sst/<stem> (the SST table's models: 3-D params, two-cell files, dropout)
EXAMPLES_BY_NAME = {
    path.relative_to(EXAMPLES).with_suffix("").as_posix(): path
    for path in sorted(EXAMPLES.glob("*.cell")) + sorted(EXAMPLES.glob("sst/*.cell"))
}


def declared_dims(path: Path, dims: dict[str, int]) -> dict[str, int]:
    """Those of `dims` that the cell file declares (the first cell's `dim`s): one set of small dims serves
    every example, whichever dims it has."""
    from cortexc import compile_file

    declared = dict(compile_file(path)[0].dims)
    return {name: value for name, value in dims.items() if name in declared}


def load_example(path: Path, dims: dict[str, int], out_dir: Path | None = None):
    """The example's package at those of `dims` it declares (`declared_dims`)."""
    import cortexc

    return cortexc.load(path, out_dir=out_dir, **declared_dims(path, dims))


def sst_path(split: str) -> Path:
    """Path of an SST split; skips the test (with the reason) when the data is absent."""
    path = SST_DIR / f"{split}.txt"
    if not path.exists():
        pytest.skip(f"SST data not found at {path} (set CORTEXC_SST_DIR)")
    return path


def random_inputs(cell, forest, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    """One random row per node (per edge for an edge input) for every input of the cell (indices in range);
    none for the inputs the runtime gives."""
    inputs = {}
    for decl in cell.inputs:
        rows = forest.num_edges if decl.on_edge else forest.num_nodes
        if decl.given_by:
            continue
        if decl.is_index:
            inputs[decl.name] = rng.integers(0, decl.index_range, rows).astype(np.int32)
        else:
            inputs[decl.name] = (scale * rng.standard_normal((rows, *decl.shape))).astype(np.float32)
    return inputs


def random_graph(num_nodes: int, num_edges: int, rng: np.random.Generator):
    """A graph (`Forest.from_edges`, at least 4 nodes) with a cycle through nodes 0..N-3, a self-loop (0), a
    repeated edge (1 -> 2 twice), `num_edges` random edges, a node no edge reaches (N-2: it only sends) and
    an isolated node (N-1)."""
    from cortexc import Forest

    ring = np.arange(num_nodes - 2)
    src = np.concatenate([ring, rng.integers(0, num_nodes - 1, num_edges), [0, 1, 1]])
    dst = np.concatenate([np.roll(ring, -1), rng.integers(0, num_nodes - 2, num_edges), [0, 2, 2]])
    return Forest.from_edges(src, dst, num_nodes=num_nodes)


def digest(arrays) -> str:
    """A SHA-256 of named arrays (their names and bytes, by name): equal digests are bitwise-equal results."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def relative_error(actual, expected) -> float:
    """Normwise, in float64: max |actual - expected| / max |expected| (0 for empty arrays)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if expected.size == 0:
        return 0.0
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def assert_saturated_close(actual, expected, name: str = "") -> None:
    """Results of saturated inputs (+-100, inf) against the interpreter's: the same non-finite values in the
    same places (NaN matching NaN), the finite ones within float32 rounding, normwise (`relative_error` 1e-5)
    and per element (1e-5 relative plus 1e-5 absolute: these states are O(1), and a chain's steps sum their
    rounding, so a lone element may be a few 1e-6 off where the normwise error is 5e-7)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=name)
    assert np.isfinite(actual[finite]).all(), name
    assert relative_error(actual[finite], expected[finite]) < 1e-5, name
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-5, atol=1e-5, err_msg=name)


def children_of(parents) -> list[list[int]]:
    """Children in increasing index order (the documented `from_parents` order), from our own array."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def small_forest(cell, rng: np.random.Generator, trees: int, max_nodes: int, chains=(7, 2, 1), dag_nodes: int = 30):
    """A forest the cell accepts: a random DAG for DAG cells, chains of the given lengths for chain
    cells, else random trees (binary for arity 2, nodes missing children for other arities)."""
    from cortexc import Forest

    if cell.structure.shares_children:
        return Forest.random_dag(dag_nodes, rng=rng)
    if cell.arity == 1:
        return Forest.concat([Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)]) for n in chains])
    return Forest.random(trees, rng=rng, binary=cell.arity == 2, max_children=cell.arity or 5, max_nodes=max_nodes)


def twin_models(module, device: str, seed: int, rng: np.random.Generator, jitter: float = 0.1, cell: str | None = None):
    """The package's cell `cell` (default its first) on `device` and in the interpreter, with the same
    params: the seeded init plus noise (so that no gradient is trivially zero)."""
    cls = getattr(module, cell or module.__all__[0])
    model, reference = cls(device=device, seed=seed), cls(device="interp", seed=seed)
    params = {k: v + jitter * rng.standard_normal(v.shape).astype(np.float32) for k, v in reference.params.items()}
    model.load_params(params)
    reference.load_params(params)
    return model, reference


def compare_backward(model, reference, out, expected, rng: np.random.Generator, rtol: float = 1e-5) -> None:
    """Random upstream gradients of every result; the two backwards must agree within `rtol`."""
    upstream = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in expected.items()}
    grads, expected_grads = model.backward(out, upstream), reference.backward(expected, upstream)
    assert set(grads) == set(expected_grads)
    for key, value in expected_grads.items():
        assert relative_error(grads[key], value) < rtol, f"d{key}"


def nvcc_compile(path: Path, device_only: bool = False, generated: bool = False) -> subprocess.CompletedProcess:
    """Compile one `.cu` to an object for sm_80 and sm_90, every warning an error, with ptxas's register
    and spill report in stderr. `device_only`: the device code alone to a cubin for sm_90 (no host
    compiler, one ptxas run: ~40% of the time; g++ compiles the same host code in the emulated runs).
    `generated`: a package's `.cu`, compiled as a user's build system would, with no include path of
    cortexc's and from another folder (it must build alone); test kernels get `-I cortexc/runtime`."""
    from cortexc.targets.cuda.host import cuda_include_flags

    if device_only:
        target = ["-arch=sm_90", "-cubin", "-o", str(path.with_suffix(".cubin"))]
    else:
        gencode = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
        target = [*gencode, "-c", "-o", str(path.with_suffix(".o"))]
    include = () if generated else cuda_include_flags()
    command = ["nvcc", *target, "-O3", "-Werror", "all-warnings", "-Xptxas", "-v", *include, str(path)]
    return subprocess.run(command, capture_output=True, text=True, cwd="/" if generated else None)


#: examples at small dims for runtime tests: a chain cell, a tree cell with an index input and an output, a
#: child-sum tree cell, a DAG cell (key -> file, dims)
SMALL_EXAMPLES = {
    "lstm": ("lstm.cell", {}),
    "binary_treelstm": ("binary_treelstm.cell", dict(V=64, X=16, H=12)),
    "treelstm": ("treelstm.cell", dict(X=16, H=12)),
    "dagrnn": ("dagrnn.cell", {}),
}


def load_small_examples(root: Path) -> dict:
    """Every `SMALL_EXAMPLES` cell compiled into `root` and imported, by key."""
    import cortexc

    return {key: cortexc.load(EXAMPLES / file, root / key, **dims) for key, (file, dims) in SMALL_EXAMPLES.items()}


def first_model(module, device: str = "cpu", seed: int = 1):
    """The model of a package's first cell."""
    return getattr(module, module.__all__[0])(device=device, seed=seed)


def chains(*lengths: int):
    """A forest of chains of these lengths (node ids in time order within each)."""
    from cortexc import Forest

    return Forest.concat([Forest.from_parents(np.r_[np.arange(1, n), -1]) for n in lengths])


def small_example_forest(key: str, rng: np.random.Generator, size: int):
    """A random forest that fits the `SMALL_EXAMPLES` cell `key`."""
    from cortexc import Forest

    if key == "lstm":
        return chains(*(int(n) for n in rng.integers(1, size, 5)))
    if key == "dagrnn":
        return Forest.random_dag(size * 3, rng=rng)
    if key == "binary_treelstm":  # nodes with one child above the leaves: child[1] reads the zero row N
        return Forest.concat([Forest.from_parents([1, 3, 3, -1]), Forest.random(6, rng=rng, max_children=2)])
    return Forest.random(6, rng=rng, max_nodes=size)


def word_child_sum(V: int, X: int, H: int) -> str:
    """A child-sum Tree-LSTM with a word at every node: the internal nodes' projections are hoisted (a
    stacked W_iou, W_f GEMM of E[word] in the pre kernel), the leaves' is W_iou's alone: two folds."""
    return f"""
cell WordChildSum on tree {{
    dim V = {V}, X = {X}, H = {H}
    input word : index[V]
    param E[V, X] init normal(0, 0.5)
    param W_iou[3*H, X], U_iou[3*H, H], b_iou[3*H]
    param W_f[H, X], U_f[H, H], b_f[H]
    state h[H], c[H]
    node {{
        x = E[word]
        iou = W_iou @ x + U_iou @ sum(child.h) + b_iou
        f = sigmoid(W_f @ x + U_f @ child.h + b_f)
        c = sigmoid(iou[0:H]) * tanh(iou[2*H:3*H]) + sum(f * child.c)
        h = sigmoid(iou[H:2*H]) * tanh(c)
    }}
}}
"""


def shuffled_ids(forest, rng: np.random.Generator):
    """The same forest with its node ids permuted, so that ids are in no topological order."""
    from cortexc import Forest

    order = rng.permutation(forest.num_nodes)
    parents = np.full(forest.num_nodes, -1)
    parents[order] = np.where(forest.parents >= 0, order[np.maximum(forest.parents, 0)], -1)
    return Forest.from_parents(parents)


def assert_packages_compile_with_nvcc_without_spills(modules) -> None:
    """Every loaded package's `.cu` builds for sm_90 as a user's build would, with no register spills."""
    import re

    for module in modules:
        (source,) = Path(next(iter(module.__path__))).glob("*.cu")
        result = nvcc_compile(source, device_only=True, generated=True)
        assert result.returncode == 0, result.stderr[-3000:]
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
        assert spills and all(stores == loads == "0" for stores, loads in spills), result.stderr[-2000:]


def digests_at_thread_counts(worker: str, cell_text: str, tmp_path: Path, threads=("1", "2")) -> list[str]:
    """Run `worker` (a script taking the `.cell` path and a package folder, printing a JSON digest last) in a
    fresh process per OMP_NUM_THREADS (libgomp reads it once), sharing one build cache; their digests."""
    import json
    import sys

    cell_file = tmp_path / "cell.cell"
    cell_file.write_text(cell_text, encoding="utf-8")
    digests = []
    for count in threads:
        env = dict(os.environ, OMP_NUM_THREADS=count, CORTEXC_CACHE=str(tmp_path / "cache"))
        done = subprocess.run(
            [sys.executable, "-c", worker, str(cell_file), str(tmp_path / "pkg")],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        digests.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return digests
