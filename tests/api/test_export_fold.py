"""Folded look-up projections in `cortexc export`: a load builds the tables (`passes.fold`), a forward reads them.

The exported outputs must be bitwise the Python API's (folded or not, `device="cpu"`), with folding on, off
(`CORTEXC_FOLD=0`, `--no-fold`) and capped (`CORTEXC_FOLD_MAX_MB`); a white-box probe (tests/c/
export_fold_probe.c, compiled with the cell's own .c) shows that the forward reads the tables (NaN-filled
tables give NaN states) and that a failed table allocation fails the load with nothing left behind (ASan).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.cli import main
from cortexc.export import export
from cortexc.runtime import safetensors
from cortexc.targets.c import executor as cpu
from tests.helpers import EXAMPLES, REPO, word_child_sum

pytestmark = [
    pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None, reason="needs make, gcc"),
    pytest.mark.slow,
]

PROBE = REPO / "tests" / "c" / "export_fold_probe.c"
BINARY_DIMS = {"V": 60, "X": 16, "H": 8}
WORD_CHILD_SUM = word_child_sum(70, 12, 6)


class Exported:
    """A cell exported (with jittered params) and built, and the same cell in Python."""

    def __init__(self, root: Path, cell_file: Path, dims: dict[str, int], fold: bool = True):
        module = cortexc.load(cell_file, root / "py", **dims)
        self.cls = getattr(module, module.__all__[0])
        self.name = self.cls.signature.name
        jitter = np.random.default_rng(3)
        model = self.cls(device="interp")
        model.load_params(
            {k: (v + 0.3 * jitter.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()}
        )
        model.save_params(root / "trained.safetensors")
        defines = [f"-D{k}={v}" for k, v in dims.items()]
        args = ["export", str(cell_file), "-o", str(root / "dist"), "--params", str(root / "trained.safetensors")]
        assert main([*args, *defines, *([] if fold else ["--no-fold"])]) == 0
        self.dir = root / "dist" / cell_file.stem
        subprocess.run(["make", "-s", "-C", str(self.dir), f"{self.name}_run", f"{self.name}_check"], check=True)
        self.params = self.dir / "params.safetensors"

    def run(self, tensors: dict[str, np.ndarray], **env: str) -> dict[str, np.ndarray]:
        inputs, outputs = self.dir / "test" / "f.in.safetensors", self.dir / "test" / "f.out.safetensors"
        safetensors.save(inputs, tensors)
        outputs.unlink(missing_ok=True)
        command = [str(self.dir / f"{self.name}_run"), str(self.params), str(inputs), str(outputs)]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
        assert result.returncode == 0 and result.stderr == "", result.stderr
        return safetensors.load(outputs)

    def folded_bytes(self, **env: str) -> int:
        command = [str(self.dir / f"{self.name}_check"), "folded", str(self.params)]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, check=True)
        label, value = result.stdout.split()
        assert label == "folded_bytes"
        return int(value)

    def python(self, forest: Forest, inputs: dict[str, np.ndarray], fold: bool) -> dict[str, np.ndarray]:
        model = self.cls(device="cpu", fold=fold)
        model.load_params(self.params)
        got = dict(model(forest, **inputs))
        assert model._executor.fold_builds == int(fold), "the Python API did not fold as asked"
        return got


def _fold_bytes(exp: Exported) -> list[int]:
    """Each fold's table bytes, as cell.json lists them."""
    model = exp.cls(device="cpu")
    model.load_params(exp.params)
    section = model._executor_for_device().section
    return [4 * f.rows * f.m for f in section.folds]


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    return Exported(tmp_path_factory.mktemp("binary"), EXAMPLES / "binary_treelstm.cell", BINARY_DIMS)


@pytest.fixture(scope="module")
def child_sum(tmp_path_factory):
    root = tmp_path_factory.mktemp("child_sum")
    (root / "word_child_sum.cell").write_text(WORD_CHILD_SUM, encoding="utf-8")
    return Exported(root, root / "word_child_sum.cell", {})


def _forest(exp: Exported, rng, binary: bool) -> tuple[Forest, dict[str, np.ndarray]]:
    forest = Forest.random(int(rng.integers(3, 9)), rng=rng, binary=binary, max_children=3, max_nodes=31)
    words = rng.integers(0, exp.cls.signature.inputs[0].index_range, forest.num_nodes).astype(np.int32)
    return forest, {"word": words}


def _bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        assert got[name].shape == value.shape and np.array_equal(got[name], value), f"{name}: {what}"


@pytest.mark.parametrize("which", ["binary", "child_sum"])
def test_exported_folding_is_bitwise_the_python_api(request, rng, monkeypatch, which):
    monkeypatch.setenv(cpu.FOLD_VARIABLE, "eager")  # the Python API folds at its first inference
    exp = request.getfixturevalue(which)
    sizes = _fold_bytes(exp)
    assert exp.folded_bytes() == sum(sizes) > 0
    assert exp.folded_bytes(CORTEXC_FOLD="0") == 0
    for _ in range(3):
        forest, inputs = _forest(exp, rng, binary=which == "binary")
        tensors = {"parents": forest.parents.astype(np.int32), **inputs}
        folded, unfolded = exp.python(forest, inputs, True), exp.python(forest, inputs, False)
        _bitwise(folded, unfolded, "Python folded vs unfolded")
        _bitwise(exp.run(tensors), folded, "exported folded vs Python")
        _bitwise(exp.run(tensors, CORTEXC_FOLD="0"), folded, "exported with CORTEXC_FOLD=0 vs Python")
        if len(sizes) > 1:  # a cap that leaves the second table out: one table folded, the other GEMM runs
            _bitwise(exp.run(tensors, CORTEXC_FOLD_MAX_MB=str(sizes[0] / 2**20)), folded, "capped vs Python")


def test_the_memory_cap_counts_every_table_of_a_model(child_sum):
    first, second = _fold_bytes(child_sum)
    assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB=str(first / 2**20)) == first
    assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB=str((first + second) / 2**20)) == first + second
    assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB=str(min(first, second) / 2**21)) == 0
    if second < first:  # a table past the cap is skipped, a smaller one after it still built
        assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB=str(second / 2**20)) == second
    assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB="0") == 0
    assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB="-3") == 0
    assert child_sum.folded_bytes(CORTEXC_FOLD_MAX_MB=" not a number ") == first + second  # the default, 256
    assert child_sum.folded_bytes(CORTEXC_FOLD=" 0 ") == 0
    assert child_sum.folded_bytes(CORTEXC_FOLD="1") == first + second


def test_no_fold_export_runs_every_gemm_bitwise_the_same(tmp_path, binary, rng):
    plain = Exported(tmp_path, EXAMPLES / "binary_treelstm.cell", BINARY_DIMS, fold=False)
    assert plain.folded_bytes() == 0
    header = (plain.dir / f"{plain.name}.h").read_text(encoding="utf-8")
    assert "#define BINARYTREELSTM_ERROR_NO_MEMORY (-2)" in header
    assert "exported with --no-fold" in header and "#define BINARYTREELSTM_NUM_FOLDS 0" in header
    assert "#define BINARYTREELSTM_NUM_FOLDS 1" in (binary.dir / f"{binary.name}.h").read_text(encoding="utf-8")
    forest, inputs = _forest(plain, rng, binary=True)
    tensors = {"parents": forest.parents.astype(np.int32), **inputs}
    _bitwise(plain.run(tensors), binary.run(tensors), "--no-fold vs folded")


def _probe(exp: Exported, tmp: Path, sanitize: bool) -> Path:
    width = exp.cls.signature.states[0]
    assert width.name == "h"
    program = tmp / f"probe_{exp.name}{'_asan' if sanitize else ''}"
    flags = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"] if sanitize else ["-O2"]
    command = ["gcc", *flags, "-fopenmp", "-std=gnu11", f"-I{exp.dir}", f"-DCELL={exp.name}"]
    command += [
        f'-DCELL_C="{exp.name}.c"',
        f'-DCELL_IO="{exp.name}_io.h"',
        f"-DPROBE_WIDTH={int(np.prod(width.shape))}",
    ]
    subprocess.run([*command, str(PROBE), "-o", str(program), "-lm"], check=True)
    return program


def test_the_exported_forward_reads_the_folded_tables(binary, child_sum, tmp_path, rng):
    """NaN-filled tables give NaN states (every node reads a folded row or a node that did); unfolded, none."""
    for exp in (binary, child_sum):
        probe = _probe(exp, tmp_path, sanitize=False)
        forest, inputs = _forest(exp, rng, binary=exp is binary)
        path = tmp_path / "in.safetensors"
        safetensors.save(path, {"parents": forest.parents.astype(np.int32), **inputs})
        tables = len(_fold_bytes(exp))
        for env, want in (
            ({}, f"tables {tables} nodes {forest.num_nodes} nan_nodes {forest.num_nodes}"),
            ({"CORTEXC_FOLD": "0"}, f"tables 0 nodes {forest.num_nodes} nan_nodes 0"),
        ):
            result = subprocess.run(
                [str(probe), "poison", str(exp.params), str(path)],
                capture_output=True,
                text=True,
                env={**os.environ, **env},
            )
            assert result.returncode == 0 and result.stdout.strip() == want, (env, result.stdout, result.stderr)


def test_a_failed_table_allocation_fails_the_load_and_leaves_nothing(child_sum, tmp_path):
    probe = _probe(child_sum, tmp_path, sanitize=True)
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1", "OMP_NUM_THREADS": "1"}
    for index, fold in enumerate(("f0", "f1")):
        result = subprocess.run(
            [str(probe), "fail", str(child_sum.params), str(index)], capture_output=True, text=True, env=env
        )
        assert result.returncode == 1, result.stdout + result.stderr  # 2: the failed load left a model
        assert result.stdout.startswith(f"out of memory building the folded table {fold} "), result.stdout
        assert "CORTEXC_FOLD=0" in result.stdout and "Sanitizer" not in result.stderr, result.stderr
        assert result.stdout.rstrip().endswith("(-2)")  # WORDCHILDSUM_ERROR_NO_MEMORY
    result = subprocess.run([str(probe), "fail", str(child_sum.params), "2"], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == f"loaded folded_bytes {sum(_fold_bytes(child_sum))}"
    assert "Sanitizer" not in result.stderr, result.stderr
    off = {**env, "CORTEXC_FOLD": "0"}
    result = subprocess.run([str(probe), "fail", str(child_sum.params), "0"], capture_output=True, text=True, env=off)
    assert result.returncode == 0 and result.stdout.strip() == "loaded folded_bytes 0"


def test_export_api_has_a_fold_switch(tmp_path):
    """`export(fold=False)` is what `--no-fold` calls (the library's text has no table build)."""
    directory = export(EXAMPLES / "binary_treelstm.cell", tmp_path, BINARY_DIMS, fold=False)
    assert "cx_fold_all" not in (directory / "BinaryTreeLSTM.c").read_text(encoding="utf-8")
    folded = export(EXAMPLES / "binary_treelstm.cell", tmp_path / "on", BINARY_DIMS)
    assert "cx_fold_all(m, error, error_size)" in (folded / "BinaryTreeLSTM.c").read_text(encoding="utf-8")


def test_make_test_passes_for_a_folding_cell(binary):
    """`make test` (expected outputs within 1e-5, threads, caller-owned arrays, sanitizers) on a folding library."""
    assert binary.folded_bytes() > 0
    result = subprocess.run(["make", "-s", "-C", str(binary.dir), "test"], capture_output=True, text=True)
    assert result.returncode == 0 and "all passed" in result.stdout, result.stdout + result.stderr
