"""Building generated C: the cache keyed by source, flags and compiler; build errors; `cortexc compile`.

gcc is counted by wrapping `run_tool` as cortexc.runtime.build calls it; tests that count builds
use a cache directory of this module only (`build_cache`), the others the session's private cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest, reference
from cortexc.cli import main
from cortexc.runtime import build
from cortexc.runtime.package import PackageSpec
from tests.helpers import EXAMPLES, REPO, random_inputs

TINY = """\
# a small cell whose kernels build fast
cell Tiny on tree {
    dim X = 3, H = 4
    input x[X]
    param W[H, X], U[H, H]
    state h[H]
    node { h = tanh(W @ x + sum(U @ child.h)) }
}
"""


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory) -> Path:
    """A cache directory for the build-counting tests of this module."""
    return tmp_path_factory.mktemp("build-cache")


@pytest.fixture
def gcc_calls(monkeypatch, build_cache) -> list[list[str]]:
    """Every compiler invocation that builds a library (not `--version`), with this module's cache."""
    monkeypatch.setenv("CORTEXC_CACHE", str(build_cache))
    calls: list[list[str]] = []
    real_run = build.run_tool

    def counting_run(command, *args, **kwargs):
        if isinstance(command, list | tuple) and "-shared" in command:
            calls.append(list(command))
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(build, "run_tool", counting_run)
    build.load_library.cache_clear()
    yield calls
    build.load_library.cache_clear()


def libraries(directory: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in directory.glob("*.so")}


def write_cell(directory: Path, text: str, stem: str = "tiny") -> Path:
    path = directory / f"{stem}.cell"
    path.write_text(text, encoding="utf-8")
    return path


def run_tiny(module, cell_name: str = "Tiny") -> dict[str, np.ndarray]:
    """A fresh model (a fresh executor, so the library is looked up again) on a small forest."""
    model = getattr(module, cell_name)(device="cpu", seed=0)
    forest = Forest.random(4, 0, max_children=3)
    inputs = random_inputs(model.cell, forest, np.random.default_rng(0))
    out = model(forest, **inputs)
    ref = reference.run(model.cell, forest, model.params, inputs)
    for name in ref:
        assert np.abs(out[name] - ref[name]).max() <= 1e-5 * max(np.abs(ref[name]).max(), 1.0)
    return out


@pytest.fixture(scope="module")
def cell_files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("build-cells")


# ----------------------------------------------------------------------------- the cache


def test_unchanged_cell_is_not_rebuilt(gcc_calls, build_cache, cell_files):
    path = write_cell(cell_files, TINY)
    run_tiny(cortexc.load(path))
    assert len(gcc_calls) <= 1  # 0 when another test of this module built it first
    before = libraries(build_cache)
    assert len(before) >= 1

    gcc_calls.clear()
    build.load_library.cache_clear()
    module = cortexc.load(path)  # compiles the .cell again, writes the package again
    run_tiny(module)
    run_tiny(module)
    assert gcc_calls == []
    assert libraries(build_cache) == before  # same files, same mtimes


def test_a_fresh_process_reuses_the_cached_library(build_cache, cell_files, monkeypatch):
    path = write_cell(cell_files, TINY)
    monkeypatch.setenv("CORTEXC_CACHE", str(build_cache))
    script = textwrap.dedent(f"""
        import numpy as np, cortexc
        from cortexc import Forest
        module = cortexc.load({str(path)!r})
        model = module.Tiny(device="cpu", seed=0)
        forest = Forest.random(3, 0)
        print(model(forest, x=np.ones((forest.num_nodes, 3), np.float32))["h"].sum())
    """)

    def fresh_run() -> str:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = fresh_run()
    before = libraries(build_cache)
    assert fresh_run() == first
    assert libraries(build_cache) == before


def test_changed_dims_build_a_new_library(gcc_calls, build_cache, cell_files):
    path = write_cell(cell_files, TINY)
    run_tiny(cortexc.load(path))
    before = libraries(build_cache)
    gcc_calls.clear()
    out = run_tiny(cortexc.load(path, H=6))
    assert out["h"].shape[1] == 6
    assert len(gcc_calls) == 1
    added = set(libraries(build_cache)) - set(before)
    assert len(added) == 1 and next(iter(added)).startswith("tiny_Tiny-")


def test_changed_text_builds_a_new_library_but_a_comment_does_not(gcc_calls, build_cache, cell_files):
    run_tiny(cortexc.load(write_cell(cell_files, TINY)))
    before = libraries(build_cache)
    gcc_calls.clear()

    # the key is the hash of the generated C: a comment does not change it
    commented = TINY.replace("# a small cell", "# a small, commented cell")
    run_tiny(cortexc.load(write_cell(cell_files, commented)))
    assert gcc_calls == []
    assert libraries(build_cache) == before

    changed = TINY.replace("h = tanh(", "h = relu(")
    run_tiny(cortexc.load(write_cell(cell_files, changed)))
    assert len(gcc_calls) == 1
    assert len(set(libraries(build_cache)) - set(before)) == 1


def test_changed_flags_or_compiler_change_the_key(gcc_calls, build_cache, monkeypatch):
    source = "int cx_answer(void) { return 42; }\n"
    base = build.build_shared(source, "flags")
    other = build.build_shared(source, "flags", flags=build.C_FLAGS + ("-DCX_TEST_FLAG=1",))
    assert base != other and base.exists() and other.exists()
    assert len(gcc_calls) == 2
    assert any("-DCX_TEST_FLAG=1" in call for call in gcc_calls)
    assert build.build_shared(source, "flags") == base
    assert len(gcc_calls) == 2

    key = build.build_key(source, build.C_FLAGS, "gcc")
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "gcc (made up) 99.0")
    assert build.build_key(source, build.C_FLAGS, "gcc") != key


def test_the_target_cpu_changes_the_key_of_native_builds(monkeypatch):
    """A cache shared by two machines (an NFS home) must not hand one CPU's -march=native code to another."""
    source = "int cx_answer(void) { return 42; }\n"
    key = build.build_key(source, build.C_FLAGS, "gcc")
    portable = tuple(f for f in build.C_FLAGS if f != "-march=native")
    portable_key = build.build_key(source, portable, "gcc")
    monkeypatch.setattr(build, "native_target", lambda compiler: "-march= another-cpu")
    assert build.build_key(source, build.C_FLAGS, "gcc") != key
    assert build.build_key(source, portable, "gcc") == portable_key  # not native: the CPU does not matter


def test_library_names_carry_the_key_and_no_scratch_is_left(gcc_calls, build_cache, cell_files):
    run_tiny(cortexc.load(write_cell(cell_files, TINY)))
    for entry in build_cache.iterdir():
        assert entry.suffix == ".so" or entry.name == "packages", f"left in the cache: {entry.name}"
    for name in libraries(build_cache):
        stem, _, key = name[: -len(".so")].rpartition("-")
        assert stem and len(key) == 24 and all(c in "0123456789abcdef" for c in key)


# ----------------------------------------------------------------------------- a cache that can't be poisoned

ANSWER = "int cx_answer(void) { return 42; }\n"
OTHER = "int cx_answer(void) { return 7; }\n"


@pytest.fixture(scope="module")
def good_libraries(tmp_path_factory) -> dict[str, Path]:
    """Cached libraries of ANSWER and OTHER, built in a cache of their own (copied into fresh caches below, at
    paths this process never loaded: dlopen returns an already loaded path's handle without reading it)."""
    cache = tmp_path_factory.mktemp("good-libraries")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CORTEXC_CACHE", str(cache))
        return {"answer": build.build_shared(ANSWER, "victim"), "other": build.build_shared(OTHER, "victim")}


def _damage(kind: str, library: Path, good: dict[str, Path], rng: np.random.Generator) -> None:
    data = good["answer"].read_bytes()
    if kind == "truncated":
        library.write_bytes(data[: len(data) // 2])
    elif kind == "garbage after the header":
        library.write_bytes(data[:64] + rng.integers(0, 256, len(data) - 64, dtype=np.uint8).tobytes())
    elif kind == "random bytes":
        library.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "empty":
        library.write_bytes(b"")
    elif kind == "a directory":
        library.mkdir()
        (library / "inside").write_text("x", encoding="utf-8")
    elif kind == "another cell's library":
        library.write_bytes(good["other"].read_bytes())
    elif kind == "an old library without its trailer":
        library.write_bytes(data[: -build.TRAILER_SIZE])
    elif kind == "a sealed file that does not load":  # passes the check, fails dlopen: built again too
        body = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
        library.write_bytes(body + build._trailer(body, library.stem.rpartition("-")[2]))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "truncated",
        "garbage after the header",
        "random bytes",
        "empty",
        "a directory",
        "another cell's library",
        "an old library without its trailer",
        "a sealed file that does not load",
    ],
)
def test_a_damaged_cached_library_is_built_again(kind, tmp_path, monkeypatch, good_libraries, rng):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path))
    library = tmp_path / good_libraries["answer"].name
    _damage(kind, library, good_libraries, rng)
    calls: list[list[str]] = []
    real_run = build.run_tool
    monkeypatch.setattr(build, "run_tool", lambda command: calls.append(command) or real_run(command))
    assert build.build_shared(ANSWER, "victim") == library
    assert len([c for c in calls if "-shared" in c]) == 1
    assert ctypes.CDLL(str(library)).cx_answer() == 42
    assert build.verify_library(library, library.stem.rpartition("-")[2])
    assert [p.name for p in tmp_path.iterdir()] == [library.name]  # no scratch left


def test_an_intact_cached_library_is_verified_and_reused(tmp_path, monkeypatch, good_libraries):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path))
    library = tmp_path / good_libraries["answer"].name
    library.write_bytes(good_libraries["answer"].read_bytes())
    monkeypatch.setattr(build, "_build", lambda *args: pytest.fail("an intact library was built again"))
    assert build.build_shared(ANSWER, "victim") == library


FAKE_CC = """#!/bin/sh
# a compiler that answers questions at once and hangs on a build (its pid in $FAKE_CC_PIDS)
case " $* " in *" -shared "*) echo $$ >> "$FAKE_CC_PIDS"; exec sleep 60;; esac
echo "fake-cc 1.0"
"""


@pytest.fixture
def hanging_cc(tmp_path, monkeypatch):
    compiler = tmp_path / "hanging-cc"
    compiler.write_text(FAKE_CC, encoding="utf-8")
    compiler.chmod(0o755)
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_CC_PIDS", str(pids))
    yield str(compiler), pids
    for pid in pids.read_text().split() if pids.exists() else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def test_a_compiler_that_never_exits_is_stopped(hanging_cc, tmp_path, monkeypatch):
    compiler, pids = hanging_cc
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CORTEXC_BUILD_TIMEOUT", "1")
    started = time.monotonic()
    with pytest.raises(cortexc.BuildError, match="did not finish within 1 s"):
        build.build_shared(ANSWER, "hangs", compiler=compiler)
    assert time.monotonic() - started < 10
    (pid,) = map(int, pids.read_text().split())
    assert not _alive(pid)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_build_killed_midway_leaves_nothing_that_lasts(hanging_cc, tmp_path, monkeypatch):
    """SIGKILL during a build leaves its scratch directory; a later build removes it once no live build can
    own it (and keeps a young one: that may be another process building now)."""
    compiler, pids = hanging_cc
    cache = tmp_path / "cache"
    monkeypatch.setenv("CORTEXC_CACHE", str(cache))
    script = f"from cortexc.runtime import build; build.build_shared({ANSWER!r}, 'killed', compiler={compiler!r})"
    victim = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids.exists(), "the build never started"
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    (left,) = cache.iterdir()
    assert left.name.startswith(".build-killed-")
    legacy = cache / "tmpab12cd34"  # what tempfile left before scratch had its own prefix
    legacy.mkdir()
    young = cache / ".build-other-x1y2z3"
    young.mkdir()
    old = time.time() - build.build_timeout() - 120
    for path in (left, legacy):
        os.utime(path, (old, old))
    library = build.build_shared(ANSWER, "after")
    assert sorted(p.name for p in cache.iterdir()) == sorted([library.name, young.name])


def test_a_failing_compiler_says_how_it_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path))
    with pytest.raises(cortexc.BuildError, match=r"/bin/false exited with status 1:\n\(it printed nothing\)"):
        build.build_shared(ANSWER, "nothing", compiler="/bin/false")


def test_the_emulator_without_gxx_asks_for_gxx(tmp_path, monkeypatch):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path))
    real_which = build.shutil.which
    monkeypatch.setattr(build.shutil, "which", lambda name: None if name == "g++" else real_which(name))
    build.compiler_version.cache_clear()
    try:
        with pytest.raises(cortexc.BuildError, match=r"needs g\+\+ for device='cuda-emu'"):
            from cortexc.targets.cuda.emulated import build_emulated

            build_emulated("int f(void) { return 0; }", "noemu")
    finally:
        build.compiler_version.cache_clear()


# ----------------------------------------------------------------------------- build errors


def test_compile_failure_raises_build_error_and_caches_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CORTEXC_CACHE", str(cache))
    with pytest.raises(cortexc.BuildError) as info:
        build.build_shared("this is not C", "bad")
    message = str(info.value)
    assert "bad.c" in message  # the file that failed
    assert "error" in message and "this" in message  # gcc's own diagnostic
    assert list(cache.iterdir()) == []  # no library, no scratch directory

    with pytest.raises(cortexc.BuildError, match="kernels/Bad.c"):
        build.build_shared("int broken(void) { return }", "bad", source_path="kernels/Bad.c")
    assert list(cache.iterdir()) == []
    assert isinstance(info.value, cortexc.CortexcError)


def test_missing_compiler_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path))
    with pytest.raises(cortexc.BuildError, match="not found"):
        build.build_shared("int f(void) { return 0; }", "nocc", compiler="cortexc-no-such-cc")


# ----------------------------------------------------------------------------- cortexc compile


@pytest.fixture(scope="module")
def compiled_treelstm(tmp_path_factory) -> Path:
    """`cortexc compile examples/treelstm.cell -o OUT --dump-ir DUMP` (in process)."""
    out = tmp_path_factory.mktemp("compile-out")
    dump = out / "ir"
    assert main(["compile", str(EXAMPLES / "treelstm.cell"), "-o", str(out), "--dump-ir", str(dump)]) == 0
    return out


def test_compile_writes_the_package(compiled_treelstm):
    package = compiled_treelstm / "treelstm"
    assert {p.name for p in package.iterdir()} == {
        "__init__.py",
        "ChildSumTreeLSTM.c",
        "ChildSumTreeLSTM.cu",
        "cell.json",
    }
    description = PackageSpec.from_json(json.loads((package / "cell.json").read_text(encoding="utf-8")))
    assert description.package == "treelstm"
    (cell,) = description.cells
    signature = cell.signature
    assert signature.name == "ChildSumTreeLSTM" and signature.structure.kind == "tree"
    assert dict(signature.dims) == {"X": 300, "H": 150}
    assert {p.name: p.shape for p in signature.params} == {
        "W_iou": (450, 300),
        "U_iou": (450, 150),
        "b_iou": (450,),
        "W_f": (150, 300),
        "U_f": (150, 150),
        "b_f": (150,),
    }
    assert [(i.name, i.shape, i.index_range) for i in signature.inputs] == [("x", (300,), None)]
    assert [s.name for s in signature.states] == ["h", "c"]
    assert signature.outputs == ()
    for section in cell.targets.values():
        kernels = [k["kernel"] for k in section.schedule]
        assert "leaf" in kernels and "node" in kernels and all(k["steps"] for k in section.schedule)
    assert {t: s.kernel_file for t, s in cell.targets.items()} == {
        "c": "ChildSumTreeLSTM.c",
        "cuda": "ChildSumTreeLSTM.cu",
    }
    for section in cell.targets.values():
        source = (package / section.kernel_file).read_text(encoding="utf-8")
        assert "cx_forward" in source and "treelstm.cell" in source


@pytest.mark.parametrize("target, suffixes", [("cpu", {".c"}), ("cuda", {".cu"}), ("all", {".c", ".cu"})])
def test_compile_target_chooses_the_kernel_sources(tmp_path, target, suffixes):
    assert main(["compile", str(EXAMPLES / "treernn.cell"), "-o", str(tmp_path), "--target", target]) == 0
    package = tmp_path / "treernn"
    assert {p.suffix for p in package.iterdir() if p.suffix.startswith(".c")} == suffixes


def test_compile_with_defines_and_two_cells(tmp_path):
    text = TINY + TINY.replace("Tiny", "Tiny2").replace("# a small cell whose kernels build fast\n", "")
    path = write_cell(tmp_path, text, "pair")
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "-D", "H=5", "--target", "cpu"]) == 0
    package = tmp_path / "out" / "pair"
    assert {p.name for p in package.iterdir()} == {"__init__.py", "Tiny.c", "Tiny2.c", "cell.json"}
    description = PackageSpec.from_json(json.loads((package / "cell.json").read_text(encoding="utf-8")))
    assert [dict(c.signature.dims)["H"] for c in description.cells] == [5, 5]
    assert description.defines == {"H": 5}


def test_dump_ir_writes_the_stages(compiled_treelstm):
    dumped = sorted(p.name for p in (compiled_treelstm / "ir").iterdir())
    assert dumped[:3] == [
        "ChildSumTreeLSTM.00-lower.ir",
        "ChildSumTreeLSTM.01-specialize.ir",
        "ChildSumTreeLSTM.02-hoist.ir",
    ]
    assert dumped[3:] == [
        "ChildSumTreeLSTM.03-autodiff.ir",
        "ChildSumTreeLSTM.04-schedule.prog",
        "ChildSumTreeLSTM.05-target.c.prog",
        "ChildSumTreeLSTM.05-target.cuda.prog",
    ]
    for name in dumped:
        head = "cell" if name.endswith(".ir") else "program"
        assert (compiled_treelstm / "ir" / name).read_text(encoding="utf-8").startswith(f"{head} ChildSumTreeLSTM")


def test_bad_cell_exits_1_and_writes_nothing(tmp_path):
    path = write_cell(tmp_path, "cell Bad on tree {\n    state h[2]\n    node { h = nope }\n}\n", "bad")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "cortexc.cli", "compile", str(path), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 1
    assert f"{path}:3:16: error: unknown name 'nope'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() or list(out.iterdir()) == []


def test_bad_cell_leaves_a_previous_package_alone(tmp_path, capsys):
    path = write_cell(tmp_path, TINY)
    out = tmp_path / "out"
    assert main(["compile", str(path), "-o", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in (out / "tiny").iterdir()}
    path.write_text(TINY.replace("h = tanh(", "h = tanh(y + "), encoding="utf-8")
    assert main(["compile", str(path), "-o", str(out)]) == 1
    assert "unknown name 'y'" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (out / "tiny").iterdir()} == before
    assert [p.name for p in out.iterdir()] == ["tiny"]  # no staging directory left behind


def test_generated_package_is_importable_from_its_directory(compiled_treelstm, monkeypatch):
    monkeypatch.syspath_prepend(str(compiled_treelstm))
    monkeypatch.delitem(sys.modules, "treelstm", raising=False)
    try:
        treelstm = importlib.import_module("treelstm")
        assert Path(treelstm.__file__).parent == compiled_treelstm / "treelstm"
        assert treelstm.__all__ == ["ChildSumTreeLSTM"]
        model = treelstm.ChildSumTreeLSTM(device="cpu", seed=0)
        assert model.params["W_iou"].shape == (450, 300)
        forest = Forest.random(6, 1, max_children=4)
        inputs = random_inputs(model.cell, forest, np.random.default_rng(1))
        out = model(forest, **inputs)
        ref = reference.run(model.cell, forest, model.params, inputs)
        for name in ("h", "c"):
            assert out[name].shape == (forest.num_nodes, 150)
            assert np.abs(out[name] - ref[name]).max() <= 1e-5 * np.abs(ref[name]).max()
    finally:
        sys.modules.pop("treelstm", None)


# ----------------------------------------------------------------------------- known bug


STALE_KERNEL = """
import sys
import numpy as np, cortexc
from cortexc import Forest
from cortexc import reference
out_dir, path = sys.argv[1], sys.argv[2]
wide = cortexc.load(path, out_dir, H=9)    # writes OUT/dagrnn/ for H=9
cortexc.load(path, out_dir, H=7)           # the same directory, now H=7 (smaller: no overflow)
model = wide.DagRNN(device="cpu", seed=0)  # first run: reads the kernel source from OUT/dagrnn/
forest = Forest.random_dag(30, 0)
x = np.random.default_rng(0).standard_normal((30, 32)).astype(np.float32)
got = model(forest, x=x)["h"]
ref = reference.run(model.cell, forest, model.params, {"x": x})["h"]
error = float(np.abs(got - ref).max() / np.abs(ref).max())
print(f"max rel err {error:.3e}")
sys.exit(0 if error < 1e-5 else 1)
"""


def test_reusing_an_out_dir_does_not_change_an_already_loaded_module(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", STALE_KERNEL, str(tmp_path / "out"), str(EXAMPLES / "dagrnn.cell")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr


CONCURRENT_LOADS = """
import sys
import cortexc
errors = []
for _ in range(25):
    try:
        cortexc.load(sys.argv[1])
    except Exception as err:  # noqa: BLE001 - report every failure
        errors.append(f"{type(err).__name__}: {err}")
print(len(errors), errors[:2])
sys.exit(1 if errors else 0)
"""


def test_concurrent_loads_of_the_same_cell(tmp_path, monkeypatch, cell_files):
    path = write_cell(cell_files, TINY)
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    cortexc.load(path)  # the kernels need not be built: this is about the package directory
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_LOADS, str(path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    reports = [(w.wait(timeout=120), w.stdout.read()) for w in workers]
    assert all(code == 0 for code, _ in reports), reports


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_threads_loading_the_same_cell_all_get_its_classes(cache, tmp_path, monkeypatch, cell_files):
    """The package module is in sys.modules before it has run: no thread may take it from there half-made."""
    import threading

    cell = f"Threads{cache.title()}"  # a cell of its own: a module name never imported before
    path = write_cell(cell_files, TINY.replace("Tiny", cell), f"threads_{cache}")
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / cache))
    if cache == "warm":
        # built and installed by another process: on disk, not in this one's sys.modules
        script = f"import cortexc; cortexc.load({str(path)!r}, {str(tmp_path / 'warm-out')!r})"
        subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True)
    from cortexc.runtime import model

    real_load_package = model.load_package

    def slow_load_package(directory):  # what the package runs, made slow: the window in which it is half-made
        time.sleep(0.2)
        return real_load_package(directory)

    monkeypatch.setattr(model, "load_package", slow_load_package)
    start = threading.Barrier(4)
    results: list[object] = []

    def load() -> None:
        start.wait()
        try:
            results.append(getattr(cortexc.load(path, tmp_path / f"{cache}-out"), cell))
        except Exception as err:  # noqa: BLE001 - every failure is reported
            results.append(err)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(r, type) for r in results), results
    assert len(set(results)) == 1


def test_an_identical_package_that_appears_meanwhile_is_never_moved(tmp_path, monkeypatch):
    """Two writers into one empty cache: the second must not move the first's package (being imported) aside."""
    from cortexc.codegen import module

    files = {"__init__.py": "X = 1\n", "cell.json": "{}\n"}
    installed = module._install(tmp_path, "pkg", files)
    inode = installed.stat().st_ino
    real = module._same_contents
    looks = []

    def late_look(directory, contents):  # the second writer's first look found nothing: the first was not done
        looks.append(directory)
        return len(looks) > 1 and real(directory, contents)

    monkeypatch.setattr(module, "_same_contents", late_look)
    assert module._install(tmp_path, "pkg", files) == installed
    assert installed.stat().st_ino == inode
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]
    other = {"__init__.py": "X = 2\n", "cell.json": "{}\n"}  # a different package is replaced
    assert (module._install(tmp_path, "pkg", other) / "__init__.py").read_text() == "X = 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_compiled_package_directory_is_readable_by_others(tmp_path):
    """`cortexc compile -o build/` makes a package for everyone who can read build/ (not a 0700 temp dir)."""
    out = tmp_path / "out"
    assert main(["compile", str(write_cell(tmp_path, TINY)), "-o", str(out)]) == 0
    assert (out / "tiny").stat().st_mode & 0o055 == 0o055


@pytest.mark.parametrize("file", ["class.cell", "lambda.cell", "None.cell"])
def test_package_name_is_importable(file):
    import keyword

    from cortexc.codegen.module import package_name

    name = package_name(file)
    assert name.isidentifier() and not keyword.iskeyword(name), name


# ----------------------------------------------------------------------------- where cortexc writes


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_cache_that_cannot_be_a_directory_is_an_output_error(where, tmp_path, monkeypatch, cell_files):
    blocker = tmp_path / "blocker"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("CORTEXC_CACHE", str(blocker if where == "a file" else blocker / "cache"))
    with pytest.raises(cortexc.OutputError, match="the cortexc cache .* cannot be made"):
        cortexc.load(write_cell(cell_files, TINY))


def test_a_full_disk_while_building_or_installing_is_an_output_error(tmp_path, monkeypatch, cell_files):
    import errno
    import tempfile

    from cortexc.codegen import module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build.tempfile, "mkdtemp", full)
    with pytest.raises(cortexc.OutputError, match="cannot write the library .* No space left"):
        build.build_shared(ANSWER, "full")
    monkeypatch.setattr(build.tempfile, "mkdtemp", tempfile.mkdtemp)
    monkeypatch.setattr(module.tempfile, "mkdtemp", full)
    with pytest.raises(cortexc.OutputError, match="cannot write the package tiny .* No space left"):
        cortexc.load(write_cell(cell_files, TINY), tmp_path / "out")


@pytest.mark.parametrize("damage", ["cell.json garbage", "cell.json missing", "__init__.py broken", "kernel missing"])
def test_importing_a_damaged_package_is_an_output_error(damage, tmp_path):
    from cortexc.runtime.loader import import_package

    assert (
        main(["compile", str(write_cell(tmp_path, TINY.replace("Tiny", "Damaged"), "damaged")), "-o", str(tmp_path)])
        == 0
    )
    package = tmp_path / "damaged"
    if damage == "cell.json garbage":
        (package / "cell.json").write_text('{"format": 2, "cells": [', encoding="utf-8")
    elif damage == "cell.json missing":
        (package / "cell.json").unlink()
    elif damage == "__init__.py broken":
        (package / "__init__.py").write_text("def (:\n", encoding="utf-8")
    else:
        (package / "Damaged.c").unlink()
    with pytest.raises(cortexc.OutputError, match=f"the package {package} is damaged"):
        import_package(package)


def test_a_build_says_it_is_building_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path))
    build.build_shared(ANSWER, "quiet")
    assert capsys.readouterr().err == ""  # not a terminal: nothing
    monkeypatch.setattr(build, "_interactive", lambda: True)
    build.build_shared(OTHER, "told")
    assert capsys.readouterr().err.startswith("cortexc: building told with gcc (once: cached in ")
    build.build_shared(OTHER, "told")  # from the cache: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("machine, x86", [("x86_64", True), ("AMD64", True), ("aarch64", False), ("ppc64le", False)])
def test_the_vector_width_flag_is_given_on_x86_only(machine, x86, monkeypatch):
    """`-mprefer-vector-width=512` (16-lane loops on AVX-512) is an x86 option: gcc and clang for other
    machines reject it, so there the build must not pass it."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: machine)
    try:
        reloaded = importlib.reload(build)
        assert ("-mprefer-vector-width=512" in reloaded.C_FLAGS) == x86
        assert "-march=native" in reloaded.C_FLAGS and "-ffast-math" in reloaded.C_FLAGS
    finally:
        monkeypatch.undo()
        importlib.reload(build)
    assert ("-mprefer-vector-width=512" in build.C_FLAGS) == (platform.machine().lower() in ("x86_64", "amd64"))
