"""The compiled CPU code is bitwise reproducible: run to run, and between 1 and N threads.

Every sum has one order whatever the threads (fixed tiles, deferred weight gradients summed over their
rows in order per output block, bias gradients per chunk summed in chunk order, a DAG child's and an
embedding row's gradient added in row order after each launch), so the forward and the backward of a
forest are the same bits with 1, 2 or 3 threads. Thread counts are set
through `OMP_NUM_THREADS` in fresh processes (libgomp reads it once). The forests have levels of many
tiles (more than the chunks) and levels of one row, so the threads' shared and single-thread paths both
run; the schedule is also checked against the interpreter on forests mixing tiny and huge levels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from tests.helpers import EXAMPLES, REPO, compare_backward, random_inputs, relative_error, sst_path, twin_models

pytestmark = pytest.mark.slow

#: cell file -> (defines, cell class); small dims so a forest of thousands of nodes runs fast
CELLS = {
    "dagrnn": ("dagrnn.cell", {"X": 12, "H": 20}),
    "binary_treelstm": ("binary_treelstm.cell", {"V": 40, "X": 12, "H": 10, "C": 3}),
    "lstm": ("lstm.cell", {"X": 7, "H": 9}),
    # wide enough that the C backward defers the weight gradients (one GEMM per term whose output blocks
    # the threads share, see driver_c_deferred.j2); W_s stays per tile
    "binary_treelstm_wide": ("binary_treelstm.cell", {"V": 40, "X": 200, "H": 100, "C": 200}),
    "dagrnn_wide": ("dagrnn.cell", {"X": 200, "H": 200}),
    # hidden sizes of whole GEMM panels (16 floats) with GEMMs large enough (>= 2^20 multiply-adds a level)
    # that the C target shares a level of one tile by columns among the threads (passes/columns.py,
    # c/driver.j2): 208 is 13 panels, so 2 threads own 6 and 7, 3 threads 4, 4 and 5
    "lstm_split": ("lstm.cell", {"X": 7, "H": 208}),
    "binary_treelstm_split": ("binary_treelstm.cell", {"V": 40, "X": 12, "H": 144, "C": 3}),
    "dagrnn_split": ("dagrnn.cell", {"X": 12, "H": 512}),  # one H x H GEMM a row: 4 rows are enough
    # SST's hidden size: 16 panels, 8 per thread (test_sst_batches_...)
    "binary_treelstm_h256_split": ("binary_treelstm.cell", {"V": 40, "X": 12, "H": 256, "C": 3}),
    # 256 x 64 multiply-adds a row in the node kernel: a forward's level of 8 rows or more (but one tile) is
    # shared by the threads in blocks of rows (c/driver.j2, cx_rows_shared); too few for a column split
    "lstm_rows": ("lstm.cell", {"X": 7, "H": 64}),
}

#: run in a fresh process: builds the forest and inputs from a seed, runs forward + backward `runs`
#: times and prints a digest of every result of each run (states, outputs, gradients)
WORKER = r"""
import hashlib, json, sys
import numpy as np
import cortexc
from cortexc import Forest

package, seed, runs, trees = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from pathlib import Path
from cortexc.runtime.loader import import_package

module = import_package(Path(package))
cls = getattr(module, module.__all__[0])
rng = np.random.default_rng(seed)
model = cls(device="cpu", seed=seed)
model.load_params({k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.params.items()})
sig = model.signature
if sig.structure.shares_children:
    forest = Forest.random_dag(10 * trees, rng=rng, max_children=3, max_parents=3)
else:
    forest = Forest.concat([Forest.random(trees, rng=rng, binary=True, max_nodes=40),
                            Forest.from_nested([[[[[1, 2], 3], 4], 5], [6, 7]])])
inputs = {}
for decl in sig.inputs:
    if decl.is_index:
        inputs[decl.name] = rng.integers(0, 8, forest.num_nodes).astype(np.int32)  # repeated rows
    else:
        inputs[decl.name] = rng.standard_normal((forest.num_nodes, *decl.shape)).astype(np.float32)
out = model(forest, grad=True, **inputs)
upstream = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items()}
digests = []
for _ in range(runs):
    out = model(forest, grad=True, **inputs)
    grads = model.backward(out, upstream)
    h = hashlib.sha256()
    for name in sorted(out):
        h.update(name.encode()); h.update(np.ascontiguousarray(out[name]).tobytes())
    for name in sorted(grads):
        h.update(name.encode()); h.update(np.ascontiguousarray(grads[name]).tobytes())
    digests.append(h.hexdigest())
print(json.dumps({"digests": digests}))
"""


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Each cell's package, built once (its library cached under a module-wide CORTEXC_CACHE)."""
    cache = tmp_path_factory.mktemp("cache")
    os.environ["CORTEXC_CACHE"] = str(cache)  # the workers share it (restored below)
    built = {}
    try:
        for key, (file, defines) in CELLS.items():
            module = cortexc.load(EXAMPLES / file, out_dir=tmp_path_factory.mktemp(key), **defines)
            cls = getattr(module, module.__all__[0])
            cls(device="cpu")  # builds the library now, so the workers only load it
            built[key] = (os.path.dirname(module.__file__), str(cache))
    finally:
        os.environ.pop("CORTEXC_CACHE", None)
    return built


def _run_worker(worker: str, cache: str, threads: int, *args: str):
    """A worker script in a fresh process with exactly `threads` OpenMP threads (whatever else runs): the JSON
    of its last line."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), CORTEXC_CACHE=cache, PYTHONPATH=str(REPO))
    env.pop("CORTEXC_NUM_THREADS", None)
    env["CORTEXC_ADAPT_THREADS"] = "0"
    done = subprocess.run([sys.executable, "-c", worker, *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _digests(package: str, cache: str, threads: int, seed: int, runs: int, trees: int = 300) -> list[str]:
    return _run_worker(WORKER, cache, threads, package, str(seed), str(runs), str(trees))["digests"]


@pytest.mark.parametrize(
    "key",
    [
        "binary_treelstm",
        "dagrnn",
        "binary_treelstm_wide",
        "dagrnn_wide",
        "binary_treelstm_split",
        "dagrnn_split",
    ],
)
def test_forward_and_backward_are_bitwise_equal_run_to_run_and_across_thread_counts(key, packages, rng):
    package, cache = packages[key]
    seed = int(rng.integers(0, 2**31))
    trees = 40 if key.endswith("_split") else 300  # the wide hidden sizes: fewer trees (DAG: 10x nodes)
    two = _digests(package, cache, 2, seed, runs=5, trees=trees)
    assert len(set(two)) == 1, f"{key}: 5 runs at 2 threads differ: {two}"
    one = _digests(package, cache, 1, seed, runs=1, trees=trees)
    three = _digests(package, cache, 3, seed, runs=1, trees=trees)
    assert one[0] == two[0] == three[0], f"{key}: 1, 2 and 3 threads differ"


#: the digest the workers below print per forest: every result of an inference, a training forward and its
#: backward, in name order
DIGEST = r"""
import hashlib
import numpy as np


def digest(*results):
    h = hashlib.sha256()
    for result in results:
        for name in sorted(result):
            h.update(np.ascontiguousarray(result[name]).tobytes())
    return h.hexdigest()
"""

#: run in a fresh process: SST batches of 10 trees (random word ids), forward (inference and training) and
#: backward; prints a digest of all results per batch
SST_WORKER = (
    DIGEST
    + r"""
import json, sys
from pathlib import Path
import numpy as np
from cortexc import Forest
from cortexc.runtime.loader import import_package

package, seed, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
module = import_package(Path(package))
model = getattr(module, module.__all__[0])(device="cpu", seed=seed)
rng = np.random.default_rng(seed)
lines = Path(path).read_text().splitlines()
start = int(rng.integers(0, len(lines) - 40))
digests = []
for k in range(4):
    forest = Forest.from_ptb(lines[start + 10 * k : start + 10 * k + 10])
    word = rng.integers(0, 40, forest.num_nodes).astype(np.int32)
    inference = model(forest, word=word)
    out = model(forest, grad=True, word=word)
    grads = model.backward(out, {"logits": rng.standard_normal(out["logits"].shape).astype(np.float32)})
    digests.append(digest(inference, out, grads))
print(json.dumps(digests))
"""
)


def test_sst_batches_are_bitwise_equal_across_thread_counts(packages, rng):
    """The binary Tree-LSTM at SST's hidden size (H=256) on batches of 10 SST trees: their narrow top levels
    are shared by columns at 2 and 3 threads and run whole-width at 1; forward and backward are the same bits
    every way (random forests did not show a helper that made the two kinds of loop round differently)."""
    package, cache = packages["binary_treelstm_h256_split"]
    seed, path = int(rng.integers(0, 2**31)), str(sst_path("dev"))
    digests = [_run_worker(SST_WORKER, cache, threads, package, str(seed), path) for threads in (1, 2, 3)]
    assert digests[0] == digests[1] == digests[2]


#: run in a fresh process: chain forests of T steps x B chains on either side of the per-call thread choice
#: (levels of 16 rows run alone, of 17 are shared; 220 shared rows are too few, 300 enough); prints, per
#: forest, the threads the library chose for the forward and the backward and a digest of all results
CHAINS_WORKER = r"""
import hashlib, json, sys
from pathlib import Path
import numpy as np
from cortexc import Forest
from cortexc.runtime.linearize import linearize
from cortexc.runtime.loader import import_package

package, seed, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
module = import_package(Path(package))
model = module.LSTM(device="cpu", seed=seed)
rng = np.random.default_rng(seed)
rows = []
for T, B in shapes:
    forest = Forest.concat([Forest.from_parents(np.append(np.arange(1, T), -1))] * B)
    x = rng.standard_normal((forest.num_nodes, 7)).astype(np.float32)
    inference = model(forest, x=x)  # an inference hoists a window of levels at a time
    out = model(forest, grad=True, x=x)
    grads = model.backward(out, {"h": rng.standard_normal(out["h"].shape).astype(np.float32)})
    h = hashlib.sha256()
    for name in sorted(out):
        h.update(np.ascontiguousarray(inference[name]).tobytes())
        h.update(np.ascontiguousarray(out[name]).tobytes())
    for name in sorted(grads):
        h.update(np.ascontiguousarray(grads[name]).tobytes())
    executor = model._executor_for_device()
    lin = linearize(forest)
    rows.append([executor.call_threads(lin), executor.call_threads(lin, backward=True), h.hexdigest()])
print(json.dumps(rows))
"""


def _chain_rows(package: str, cache: str, threads: int, seed: int, shapes=((40, 16), (40, 17), (6, 20), (8, 40))):
    return _run_worker(CHAINS_WORKER, cache, threads, package, str(seed), json.dumps(shapes))


def test_the_thread_count_chosen_per_call_changes_no_bit(packages, rng):
    """Small calls run on one thread, larger ones on all: the results are the same bits either way. (The
    last has levels of 40 rows, two tiles: an inference of it runs the direct node kernel, no pre kernel.)"""
    package, cache = packages["lstm"]
    seed = int(rng.integers(0, 2**31))
    one, two = _chain_rows(package, cache, 1, seed), _chain_rows(package, cache, 2, seed)
    assert [row[:2] for row in one] == [[1, 1]] * 4
    assert [row[:2] for row in two] == [[1, 1], [2, 2], [1, 1], [2, 2]]
    assert [row[2] for row in one] == [row[2] for row in two]


def test_small_levels_shared_by_columns_change_no_bit(packages, rng):
    """Chains of batch 7 and 12 have levels of one tile: with 2 or 3 threads each thread runs every row of such a
    level for the GEMM panels it owns (so the forward goes on all threads; the backward's levels of 7 rows run
    alone, of 12 are shared by rows), with 1 thread one owns them all: the same bits every way. A chain of
    batch 1 stays on one thread (832 x 208 multiply-adds a row: 7 rows are enough for a split, 1 is not)."""
    package, cache = packages["lstm_split"]
    seed, shapes = int(rng.integers(0, 2**31)), ((40, 7), (30, 12), (60, 1))
    one, two, three = (_chain_rows(package, cache, threads, seed, shapes) for threads in (1, 2, 3))
    assert [row[:2] for row in one] == [[1, 1]] * 3
    assert [row[:2] for row in two] == [[2, 1], [2, 2], [1, 1]]
    assert [row[:2] for row in three] == [[3, 1], [3, 3], [1, 1]]
    assert [row[2] for row in one] == [row[2] for row in two] == [row[2] for row in three]


def test_small_levels_shared_by_rows_change_no_bit(packages, rng):
    """Chains of batch 8 and 10 have levels of one tile with enough GEMM work (8 x 16384 multiply-adds forward,
    8 x 32768 backward) that 2 or 3 threads share them by rows (a forward's in a block per thread, a
    backward's in two tiles, i.e. two chunks); batch 7 and 1 stay on one thread. Forward (inference and
    training), backward: the same bits at 1, 2 and 3 threads."""
    package, cache = packages["lstm_rows"]
    seed, shapes = int(rng.integers(0, 2**31)), ((60, 10), (50, 8), (40, 7), (60, 1))
    one, two, three = (_chain_rows(package, cache, threads, seed, shapes) for threads in (1, 2, 3))
    assert [row[:2] for row in one] == [[1, 1]] * 4
    assert [row[:2] for row in two] == [[2, 2], [2, 2], [1, 1], [1, 1]]
    assert [row[:2] for row in three] == [[3, 3], [3, 3], [1, 1], [1, 1]]
    assert [row[2] for row in one] == [row[2] for row in two] == [row[2] for row in three]


def test_levels_of_equal_tile_shares_change_no_bit(packages, rng):
    """Chains of batch 100, 200 and 50 have levels of 8 tiles of 12-13 and 25 rows and of 4 of 12-13
    (cx_tile_rows: an even number of tiles, which differ by at most a row): 2 threads take equal shares of them in
    order (schedule(static)) and go from level to level without a barrier (each reads only its own rows: see
    cx_aligned), 3 threads deal them out (dynamic), 1 runs them all; the backward's chunks likewise. The same bits
    every way."""
    package, cache = packages["lstm"]
    seed, shapes = int(rng.integers(0, 2**31)), ((12, 100), (6, 200), (10, 50))
    one, two, three = (_chain_rows(package, cache, threads, seed, shapes) for threads in (1, 2, 3))
    assert [row[:2] for row in two] == [[2, 2]] * 3
    assert [row[:2] for row in three] == [[3, 3]] * 3
    assert [row[2] for row in one] == [row[2] for row in two] == [row[2] for row in three]


#: run in a fresh process: per forest (a list of parts, concatenated), forward (inference and training) and
#: backward of the chain LSTM; prints a digest of all results per forest
ALIGNED_WORKER = (
    DIGEST
    + r"""
import json, sys
from pathlib import Path
import numpy as np
from tests.targets.c.test_determinism import chains_forest
from cortexc.runtime.loader import import_package

package, seed, forests = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
model = import_package(Path(package)).LSTM(device="cpu", seed=seed)
rng = np.random.default_rng(seed)
digests = []
for parts in forests:
    forest = chains_forest(parts, seed)
    x = rng.standard_normal((forest.num_nodes, 7)).astype(np.float32)
    inference = model(forest, x=x)
    out = model(forest, grad=True, x=x)
    grads = model.backward(out, {"h": rng.standard_normal(out["h"].shape).astype(np.float32)})
    digests.append(digest(inference, out, grads))
print(json.dumps(digests))
"""
)


def chains_forest(parts: list[tuple[str, int, int]], seed: int) -> Forest:
    """Parts ("aligned" | "permuted", T, B), concatenated: B chains of T steps each, numbered so that chain b
    is row b of every level ("aligned": the driver's levels without a barrier), or so that each level holds
    the chains in its own random order (node l * B + perm_l[b]: a row's child is at another row below)."""
    rng = np.random.default_rng(seed)
    forests = []
    for kind, steps, batch in parts:
        if kind == "aligned":
            forests.append(Forest.concat([_chain(steps)] * batch))
            continue
        ids = np.array([level * batch + rng.permutation(batch) for level in range(steps)])  # ids[level, chain]
        parents = np.full(steps * batch, -1)
        parents[ids[:-1].ravel()] = ids[1:].ravel()
        forests.append(Forest.from_parents(parents))
    return Forest.concat(forests)


#: aligned levels (no barrier between them at 2 threads), levels whose children are at other rows, and
#: forests where an aligned run follows wider mixed levels or is cut by a level of another width
ALIGNED_FORESTS = [
    [["aligned", 30, 40]],
    [["permuted", 30, 40]],
    [["aligned", 60, 40], ["permuted", 20, 40]],
    [["aligned", 25, 40], ["aligned", 12, 24]],
]


def test_levels_without_barriers_change_no_bit(packages, rng):
    """Forward and backward of chains whose levels the threads share without a barrier between them, next to
    levels that need one: the same bits with 1, 2 and 3 threads, and run to run."""
    package, cache = packages["lstm"]
    seed, forests = int(rng.integers(0, 2**31)), json.dumps(ALIGNED_FORESTS)
    digests = [_run_worker(ALIGNED_WORKER, cache, threads, package, str(seed), forests) for threads in (1, 2, 2, 3)]
    assert digests[0] == digests[1] == digests[2] == digests[3]


@pytest.mark.parametrize("parts", ALIGNED_FORESTS[1:])
def test_levels_without_barriers_against_the_interpreter(parts, rng, tmp_path_factory, monkeypatch):
    """The same forests at H=64 (levels of 40 rows shared by the threads, whatever else runs) against the
    interpreter: a level that read a row another thread had not yet written would differ."""
    monkeypatch.setenv("CORTEXC_ADAPT_THREADS", "0")
    forest = chains_forest(parts, int(rng.integers(0, 2**31)))
    _check(EXAMPLES / "lstm.cell", {"X": 7, "H": 64}, forest, rng, tmp_path_factory, monkeypatch)


# ------------------------------------------------- the schedule against the interpreter, tiny + huge levels


def _chain(n: int) -> Forest:
    return Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)])


def _star(n: int) -> Forest:
    return Forest.from_parents([n - 1] * (n - 1) + [-1])


def _check(path, defines, forest, rng, tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    module = cortexc.load(path, out_dir=tmp_path_factory.mktemp("pkg"), **defines)
    model, reference = twin_models(module, "cpu", 5, rng)
    inputs = random_inputs(model.cell, forest, rng)
    out, expected = model(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    inference = model(forest, **inputs)
    for name, value in expected.items():
        assert relative_error(out[name], value) < 1e-5, name
        assert relative_error(inference[name], value) < 1e-5, name
    compare_backward(model, reference, out, expected, rng)


def test_chains_short_and_long_against_the_interpreter(rng, tmp_path_factory, monkeypatch):
    """Levels of one row (a long chain: no barrier) next to levels of hundreds (many short chains)."""
    forest = Forest.concat([_chain(300)] + [_chain(int(n)) for n in rng.integers(1, 6, 400)])
    _check(EXAMPLES / "lstm.cell", {"X": 7, "H": 9}, forest, rng, tmp_path_factory, monkeypatch)


def test_stars_chains_and_trees_against_the_interpreter(rng, tmp_path_factory, monkeypatch):
    """A level of 700 leaves under one root, chains, random trees: small and large levels interleaved."""
    forest = Forest.concat([_star(700), _chain(60), Forest.random(50, rng=rng, max_nodes=30), _star(3)])
    _check(EXAMPLES / "treelstm.cell", {"X": 6, "H": 8}, forest, rng, tmp_path_factory, monkeypatch)


def test_levels_shared_by_columns_against_the_interpreter(rng, tmp_path_factory, monkeypatch):
    """Cells whose hidden size is whole GEMM panels, on forests of small levels the threads share by columns
    (exactly the threads the shape asks for, whatever else runs): chains of batch 7 and SST trees."""
    monkeypatch.setenv("CORTEXC_ADAPT_THREADS", "0")
    chains = Forest.concat([_chain(40)] * 7 + [_chain(int(n)) for n in rng.integers(2, 30, 6)])
    _check(EXAMPLES / "lstm.cell", {"X": 7, "H": 208}, chains, rng, tmp_path_factory, monkeypatch)
    lines = sst_path("dev").read_text().splitlines()
    start = int(rng.integers(0, len(lines) - 10))
    trees = Forest.from_ptb(lines[start : start + 10])
    defines = {"V": 30, "X": 8, "H": 144, "C": 5}
    _check(EXAMPLES / "binary_treelstm.cell", defines, trees, rng, tmp_path_factory, monkeypatch)


def test_levels_shared_by_rows_against_the_interpreter(rng, tmp_path_factory, monkeypatch):
    """The chain LSTM at H=64 on chains of batch 10 (levels shared by rows) and of mixed lengths (levels from
    1 to 18 rows), exactly the threads the shape asks for."""
    monkeypatch.setenv("CORTEXC_ADAPT_THREADS", "0")
    chains = Forest.concat([_chain(50)] * 10 + [_chain(int(n)) for n in rng.integers(2, 40, 8)])
    _check(EXAMPLES / "lstm.cell", {"X": 7, "H": 64}, chains, rng, tmp_path_factory, monkeypatch)


def test_sst_trees_against_the_interpreter(rng, tmp_path_factory, monkeypatch):
    lines = sst_path("dev").read_text().splitlines()
    start = int(rng.integers(0, len(lines) - 150))
    forest = Forest.from_ptb(lines[start : start + 150])
    defines = {"V": 30, "X": 8, "H": 6, "C": 5}
    _check(EXAMPLES / "binary_treelstm.cell", defines, forest, rng, tmp_path_factory, monkeypatch)


THREADS_WORKER = r"""
import os, sys
from pathlib import Path
import numpy as np
from cortexc import Forest
from cortexc.runtime.loader import import_package

module = import_package(Path(sys.argv[1]))
model = getattr(module, module.__all__[0])(device="cpu", seed=0)
model(Forest.random_dag(20, rng=0), x=np.zeros((20, 12), np.float32))
lib = model._executor.lib
print(lib.cx_num_threads(), os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize(("cap", "expected"), [("", "3"), ("2", "2"), ("7", "3"), ("0", "3"), ("x", "3")])
def test_cortexc_num_threads_caps_the_threads_and_waiting_is_bounded(cap, expected, packages):
    package, cache = packages["dagrnn"]
    env = dict(os.environ, OMP_NUM_THREADS="3", CORTEXC_CACHE=cache, PYTHONPATH=str(REPO), CORTEXC_NUM_THREADS=cap)
    env["CORTEXC_ADAPT_THREADS"] = "0"
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("OMP_WAIT_POLICY", None)
    done = subprocess.run([sys.executable, "-c", THREADS_WORKER, package], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    threads, spin = done.stdout.split()
    assert (threads, spin) == (expected, "10000")


# ------------------------------------------------- other processes' load caps the threads

LOAD_WORKER = r"""
import os, sys
from pathlib import Path
import numpy as np
import cortexc.targets.c.threads as threads
from cortexc import Forest
from cortexc.runtime.loader import import_package

threads.LOADAVG = sys.argv[2]
# none of this process's threads is runnable besides the caller: an OpenMP or BLAS worker still spinning
# after numpy's or the library's start-up would count against the written runnable count (and so the test
# failed now and then on a 2-CPU machine); own_runnable has its own test
threads.own_runnable = lambda task_dir=None: 0
module = import_package(Path(sys.argv[1]))
model = getattr(module, module.__all__[0])(device="cpu", seed=0)
model(Forest.random_dag(20, rng=0), x=np.zeros((20, 12), np.float32))
print(model._executor_for_device().lib.cx_num_threads())
"""


def test_runnable_others_reads_linux_loadavg():
    from cortexc.targets.c.threads import runnable_others

    assert runnable_others(b"0.52 0.41 0.30 3/120 9999\n", 0) == 2
    assert runnable_others(b"0.52 0.41 0.30 3/120 9999\n", 1) == 1
    assert runnable_others(b"0.52 0.41 0.30 1/120 9999\n", 3) == 0
    assert runnable_others(b"", 0) is None
    assert runnable_others(b"0.1 0.2 0.3 x/4 5", 0) is None


@pytest.mark.parametrize(("others", "adapt", "expected"), [("busy", "", 1), ("none", "", 2), ("busy", "0", 2)])
def test_other_runnable_threads_cap_the_threads(others, adapt, expected, packages, tmp_path):
    """With every other CPU taken a call runs on one thread; with none taken (or the check off), on all."""
    package, cache = packages["dagrnn"]
    runnable = (os.cpu_count() or 1) if others == "busy" else 1  # the caller itself counts as one
    loadavg = tmp_path / "loadavg"
    loadavg.write_text(f"1.00 1.00 1.00 {runnable}/200 12345\n")
    env = dict(os.environ, OMP_NUM_THREADS="2", CORTEXC_CACHE=cache, PYTHONPATH=str(REPO), CORTEXC_ADAPT_THREADS=adapt)
    env.pop("CORTEXC_NUM_THREADS", None)
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WORKER, package, str(loadavg)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == (min(expected, os.cpu_count() or 1) if others == "none" else expected)


def test_reused_call_scratch_changes_no_bit(packages, rng):
    """The executor reuses the hoisted rows' buffers between calls (targets.c.memory.Scratch): a large call,
    then smaller and larger ones, on one model give the same bits as a fresh model on each forest, and a
    backward after an inference (and after a larger backward) sees zeroed gradient rows, and an inference
    between a forward and its backward does not touch the rows that forward kept."""
    from cortexc.runtime.loader import import_package

    module = import_package(Path(packages["lstm"][0]))
    cls = getattr(module, module.__all__[0])
    forests = [_chain(700), Forest.concat([_chain(5)] * 9), _chain(1), Forest.concat([_chain(300)] * 4)]
    reused = cls(device="cpu", seed=3)
    for forest in forests:
        x = rng.standard_normal((forest.num_nodes, 7)).astype("float32")
        upstream = {"h": rng.standard_normal((forest.num_nodes, 9)).astype("float32")}
        fresh = cls(device="cpu", seed=3)
        want_h = fresh(forest, x=x)["h"]
        want_g = fresh.backward(fresh(forest, grad=True, x=x), upstream)
        got_h = reused(forest, x=x)["h"]
        kept = reused(forest, grad=True, x=x)
        reused(forests[0], x=rng.standard_normal((forests[0].num_nodes, 7)).astype("float32"))  # in between
        got_g = reused.backward(kept, upstream)
        assert (got_h == want_h).all()
        assert got_g.keys() == want_g.keys() and all((got_g[k] == want_g[k]).all() for k in want_g)


def test_the_any_order_build_measured_against_sums_the_same_gradients_in_another_order(
    rng, tmp_path_factory, monkeypatch
):
    """benchmarks/bench_chain.py states the cost of determinism against the same C built with -DCX_ANY_ORDER
    (each thread adds its tiles into an accumulator of its own): that build must be right, and differ."""
    from cortexc.runtime.build import C_FLAGS, build_shared
    from cortexc.targets.c.executor import CpuExecutor

    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    module = cortexc.load(EXAMPLES / "lstm.cell", out_dir=tmp_path_factory.mktemp("pkg"), X=7, H=9)
    model, reference = twin_models(module, "cpu", 5, rng)
    cls = type(model)
    library = build_shared(cls._kernel_sources["c"], "lstm_any_order", flags=(*C_FLAGS, "-DCX_ANY_ORDER"))
    any_order, _ = twin_models(module, "cpu", 5, np.random.default_rng(0))
    any_order.load_params(model.params)
    any_order._executor = CpuExecutor(cls._spec, library)
    any_order._executor.set_params(any_order._params)
    # launches of hundreds of rows (many tiles: more than the chunks) and of one
    forest = Forest.concat([_chain(50)] + [_chain(int(n)) for n in rng.integers(1, 6, 2000)])
    inputs = random_inputs(model.cell, forest, rng)
    expected = reference(forest, grad=True, **inputs)
    upstream = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in expected.items()}
    grads = reference.backward(expected, upstream)
    ours, theirs = (m.backward(m(forest, grad=True, **inputs), upstream) for m in (model, any_order))
    for key, value in grads.items():
        assert relative_error(theirs[key], value) < 1e-5, key
        assert relative_error(ours[key], value) < 1e-5, key
    assert any(not np.array_equal(ours[key], theirs[key]) for key in grads), "the two builds sum alike"
