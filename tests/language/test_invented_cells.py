"""Every invented test cell (the stress cells of test_compiled, the gradient cells of test_autodiff, the
column-split cells of test_cuda_split, the gate-by-gate models of test_gate_by_gate, the shared-operand
cells below) through both compiled targets: the C forward and backward, its inference with the direct node
kernel and the hoisted one forced each, and
the emitted CUDA emulated on the CPU (its default launch mode: split levels where the cell allows it),
against the interpreter; and every such `.cu`'s device code compiled by nvcc for sm_90 with warnings as
errors and no register spills (the examples' test builds whole objects for sm_80 and sm_90; the host code
here is the same skeleton's, compiled by g++ in the emulated runs). The examples have their own files;
these cells reach the corners."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from tests.helpers import compare_backward, nvcc_compile, random_inputs, relative_error
from tests.ir.test_autodiff import INVENTED as GRADIENT_CELLS
from tests.ir.test_autodiff import invented_forest
from tests.language.test_gate_by_gate import CELLS as GATE_CELLS
from tests.language.test_gate_by_gate import gate_forest
from tests.targets.c.test_compiled import STRESS, stress_forest
from tests.targets.cuda.test_cuda_split import INVENTED as SPLIT_CELLS

pytestmark = pytest.mark.slow

#: IR the builder shares (equal values are one value) where passes rewrite around it: sums over the same
#: vectors in the same and in another order, a product repeated in two sums, a user's concat equal to the
#: direct kernel's operand, and both a stacked product and a plain one of the same concat
SHARED_OPERANDS = {
    "shared_sums": """
cell SharedSums on tree {
    dim X = 6, H = 5
    input x[X]
    param A[H, X], P[H, H], B[H, X], Q[H, H], C[H, X], R[H, H], V[H, X], W[H, X + H], D[H, X], S[H, H]
    state h[H]
    node {
        s = sum(child.h)
        a = A @ x + P @ s
        b = Q @ s + B @ x
        c = tanh(C @ x + R @ s + V @ x)
        d = W @ concat(x, s)
        e = tanh(D @ x + S @ s) * sigmoid(D @ x)
        h = tanh(a) * sigmoid(b) + c * tanh(d) + e
    }
}
""",
    "shared_chain": """
cell SharedChain on tree(arity = 1) {
    dim X = 4, H = 6
    input x[X]
    param A[H, X], P[H, H], B[H, X], Q[H, H], b[H]
    state h[H], c[H]
    node {
        p = child[0].h
        g = A @ x + P @ p + b
        k = B @ x + Q @ p + b
        m = A @ x + Q @ p
        c = sigmoid(g) * child[0].c + sigmoid(k) * tanh(m)
        h = tanh(c) * sigmoid(A @ x + P @ p)
    }
}
""",
}

#: stem -> (source, forest for a cell)
CELLS = {
    f"stress_{stem}": (text, lambda cell, kind=kind: stress_forest(kind, cell, 0))
    for stem, (text, kind) in STRESS.items()
}
CELLS |= {
    f"grad_{stem}": (text, lambda cell, kind=kind: invented_forest(kind, np.random.default_rng(1)))
    for stem, (kind, text) in GRADIENT_CELLS.items()
}
CELLS |= {
    f"split_{stem}": (
        text,
        lambda cell: Forest.random(
            8, rng=np.random.default_rng(2), max_children=3, max_nodes=20, binary=cell.arity == 2
        ),
    )
    for stem, text in SPLIT_CELLS.items()
}
CELLS |= {
    stem: (text, lambda cell, text=text: gate_forest(text, np.random.default_rng(3)))
    for stem, text in GATE_CELLS.items()
}
CELLS |= {
    stem: (text, lambda cell, text=text: gate_forest(text, np.random.default_rng(5)))
    for stem, text in SHARED_OPERANDS.items()
}

FORWARD_RTOL = 1e-5
BACKWARD_RTOL = 1e-5


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    cells = tmp_path_factory.mktemp("cells")
    out = tmp_path_factory.mktemp("packages")
    built = {}
    for stem, (text, _) in CELLS.items():
        path = cells / f"{stem}.cell"
        path.write_text(text, encoding="utf-8")
        built[stem] = cortexc.load(path, out_dir=out)
    return built


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
@pytest.mark.parametrize("stem", sorted(CELLS))
def test_invented_cell_forward_and_backward_match_the_interpreter(packages, stem, device):
    module = packages[stem]
    rng = np.random.default_rng(sum(map(ord, stem)))
    for name in module.__all__:
        cls = getattr(module, name)
        compiled, reference = cls(device=device, seed=4), cls(device="interp", seed=4)
        forest = CELLS[stem][1](reference.cell)
        inputs = random_inputs(reference.cell, forest, rng)
        out_c, out_r = compiled(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
        for key, expected in out_r.items():
            assert np.all(np.isfinite(out_c[key])), key
            assert relative_error(out_c[key], expected) < FORWARD_RTOL, f"{name}.{key}"
        compare_backward(compiled, reference, out_c, out_r, rng, BACKWARD_RTOL)


@pytest.mark.parametrize("stem", sorted(CELLS))
def test_invented_cell_inference_matches_the_interpreter_through_either_node_kernel(packages, stem):
    """An inference (no saved activations: the direct node kernel where the cell has one, folded tables)
    with the hoisted kernel forced, then the direct one, on the cpu."""
    module = packages[stem]
    rng = np.random.default_rng(sum(map(ord, stem)) + 1)
    for name in module.__all__:
        cls = getattr(module, name)
        compiled, reference = cls(device="cpu", seed=5), cls(device="interp", seed=5)
        forest = CELLS[stem][1](reference.cell)
        inputs = random_inputs(reference.cell, forest, rng)
        expected = reference(forest, **inputs)
        executor = compiled._executor_for_device()
        for direct in (1, 2):
            executor.direct = direct
            got = compiled(forest, **inputs)
            for key, value in expected.items():
                assert relative_error(got[key], value) < FORWARD_RTOL, f"{name}.{key} (direct={direct})"


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_invented_cell_compiles_with_nvcc_without_spills(packages):
    sources = sorted({path for module in packages.values() for path in Path(next(iter(module.__path__))).glob("*.cu")})
    assert len(sources) >= len(CELLS)  # a file may hold two cells: one .cu per cell
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda path: nvcc_compile(path, device_only=True, generated=True), sources))
    for path, result in zip(sources, results):
        assert result.returncode == 0, f"{path.name}:\n{result.stderr[-3000:]}"
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
        assert spills and all(s == ("0", "0") for s in spills), f"{path.name} spills registers"
