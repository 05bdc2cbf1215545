"""Adding a target is copying one (issue 33): a newcomer copies `cortexc/targets/cuda` to a new folder, changes
its name, its devices, a dialect macro and the compiler command, and registers the name with one line; the copy
then compiles and runs like the CUDA target.

Done here mechanically, in a temporary copy of the `cortexc` package (the repository is never touched): the
copy differs from the repository by the new folder and one line of `cortexc/targets/__init__.py` (what
`git diff --stat` would show), every file the newcomer edits is named by the recipe in
docs/architecture.md ("Add a target"), and a Python process that imports the copy compiles examples (a tree,
a chain, a DAG with edge inputs) for both targets and runs them on `cudacopy-emu`, `cuda-emu` and `interp`:
the copy's results, forward and backward, must equal the CUDA emulator's bit for bit (the same templates
and emulator) and match the interpreter. The CLI must offer and compile the new device.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
NEW = "cudacopy"  # the copied target's name, and its devices'
DEVICE = f"{NEW}-emu"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (needed by the CUDA emulator)")

#: the examples run on the copy (file, small dims): a child-sum tree, a chain, a DAG with inputs on edges
EXAMPLES = {
    "treelstm": ("treelstm.cell", dict(X=9, H=7)),
    "lstm": ("lstm.cell", dict(X=9, H=7)),
    "typed_daglstm": ("typed_daglstm.cell", dict(X=9, H=7, R=3, D=4)),
}

#: the newcomer's edits of the copied folder (its modules import each other relatively, so no module path
#: changes): (file, text, replacement), each text found once
MARK = f"#define CX_DIALECT_{NEW.upper()} 1"
PRELUDE_MARK = f"/* {NEW}: the copied target's prelude */"
EDITS = (
    ("target.py", 'name="cuda"', f'name="{NEW}"'),
    ("host.py", 'TARGET = "cuda"', f'TARGET = "{NEW}"'),
    ("backends.py", '"cuda", "cuda", _cuda,', f'"{NEW}", "{NEW}", _cuda,'),
    ("backends.py", '"cuda-emu", "cuda", _cuda_emulated,', f'"{DEVICE}", "{NEW}", _cuda_emulated,'),
    # a dialect macro: visible in the .cu, and (under the emulator) an error unless the copy's g++ flags were used
    (
        "templates/dialect.j2",
        "#define CX_MAYBE_UNUSED",
        f"{MARK}\n#if defined(CX_EMULATE) && !defined(CX_{NEW.upper()}_BUILD)\n"
        f'#error "not built by the {NEW} target\'s emulated compiler command"\n#endif\n#define CX_MAYBE_UNUSED',
    ),
    ("cuda_prelude.cuh", "/*\n * cuda_prelude.cuh", f"{PRELUDE_MARK}\n/*\n * cuda_prelude.cuh"),
    ("emulated.py", '"-O1", ', f'"-O1", "-DCX_{NEW.upper()}_BUILD=1", '),
)
REGISTRY = ("cortexc/targets/__init__.py", '("c", "cuda")', f'("c", "cuda", "{NEW}")')

_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def make_copy(root: Path) -> Path:
    """The `cortexc` package copied into `root`, with the new target folder and its one
    registration line: what a newcomer's checkout would hold."""
    package = root / "cortexc"
    shutil.copytree(REPO / "cortexc", package, ignore=_IGNORED)
    folder = package / "targets" / NEW
    shutil.copytree(package / "targets" / "cuda", folder)
    for file, text, replacement in EDITS:
        _replace_once(folder / file, text, replacement)
    _replace_once(root / REGISTRY[0], REGISTRY[1], REGISTRY[2])
    return root


def _replace_once(path: Path, text: str, replacement: str) -> None:
    content = path.read_text()
    assert content.count(text) == 1, f"{path.name}: {text!r} is not found once (the CUDA target changed?)"
    path.write_text(content.replace(text, replacement))


def _files(folder: Path) -> dict[str, Path]:
    return {
        p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> Path:
    return make_copy(tmp_path_factory.mktemp("newcomer"))


@pytest.fixture(scope="module")
def report(copy_root, tmp_path_factory) -> dict:
    """What `run_in_copy` found, run by a Python that imports the copied package."""
    out = tmp_path_factory.mktemp("copy-packages")
    code = (
        f"import sys; sys.path[:0] = [{str(copy_root)!r}]; sys.path.append({str(REPO)!r}); "
        "from tests.targets.test_copy_a_target import run_in_copy; "
        f"run_in_copy({str(copy_root)!r}, {str(out)!r})"
    )
    # the package's default launch, the emulator's default schedule, and no other package on the path
    env = {k: v for k, v in os.environ.items() if k not in ("CORTEXC_CUDA_MODE", "CX_EMU_SEED", "PYTHONPATH")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=copy_root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"the copy's run failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    result: dict = json.loads((out / "report.json").read_text())
    return result


def test_the_copy_is_the_folder_plus_one_registration_line(copy_root):
    """`git diff --stat` of the newcomer's checkout: the new folder, and one changed line in the registry."""
    repo, copy = _files(REPO / "cortexc"), _files(copy_root / "cortexc")
    new_folder = f"targets/{NEW}/"
    added = copy.keys() - repo.keys()
    assert added == {new_folder + name for name in _files(REPO / "cortexc" / "targets" / "cuda")}
    assert not repo.keys() - copy.keys()
    changed = sorted(name for name in repo if repo[name].read_bytes() != copy[name].read_bytes())
    assert changed == ["targets/__init__.py"]
    diff = difflib.unified_diff(repo[changed[0]].read_text().splitlines(), copy[changed[0]].read_text().splitlines())
    lines = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len(lines) == 2 and lines[0].startswith("-NAMES") and lines[1].startswith("+NAMES"), lines


def test_the_recipe_names_every_file_the_newcomer_edits():
    """docs/architecture.md's "Add a target" names each file the copy edits, and the registry."""
    text = (REPO / "docs" / "architecture.md").read_text()
    recipe = text[text.index("### Add a target") :]
    recipe = recipe[: recipe.index("\n### ", 1)]
    for name in sorted({file for file, _, _ in EDITS} | {REGISTRY[0]}):
        assert f"`{name}`" in recipe, f"the recipe does not name {name}"
    assert "tests/targets/test_copy_a_target.py" in recipe


def test_a_target_folder_names_no_module_of_its_own():
    """Its modules import each other relatively and find their files from `__file__`, so a copy runs as
    itself with no module path changed (the test above copies the folder as it is)."""
    for folder in ("c", "cuda"):
        for path in (REPO / "cortexc" / "targets" / folder).glob("*.py"):
            assert f"cortexc.targets.{folder}" not in path.read_text(), path


def test_the_new_target_is_registered(report):
    assert report["cortexc_file"].startswith(report["root"])  # the copy ran, not the repository's package
    assert report["names"] == ["c", "cuda", NEW]
    assert report["target_name"] == NEW
    assert report["backends"][DEVICE] == NEW and report["backends"][NEW] == NEW
    assert report["backends"]["cuda-emu"] == "cuda"  # the original's devices are unchanged


def test_the_cli_offers_and_compiles_the_new_device(report):
    cli = report["cli"]
    assert cli["choices"][DEVICE] == [NEW] and NEW in cli["choices"]["all"]
    assert cli["status"] == 0
    assert cli["package_targets"] == [NEW] and cli["kernel_files"] == ["ChildSumTreeLSTM.cu"]
    assert cli["same_as_api"], "the CLI's package does not run like cortexc's API on the new device"
    # a package without a target's kernels names a device of that target
    assert "--target cpu or all" in cli["without_c"]
    assert f"--target {NEW} or all" in cli["without_new"]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_copy_generates_the_cuda_source_plus_its_edits(report, example):
    """The copy's `.cu` is CUDA's, but for the name in its header comment and the copy's two marks."""
    result = report["examples"][example]
    assert result["kernel_files"][NEW].endswith(f".{NEW}.cu")  # beside CUDA's `.cu` in the same package
    added = [line for line in result["source_diff"] if line.startswith("+")]
    removed = [line for line in result["source_diff"] if line.startswith("-")]
    assert len(removed) == 1 and "(cuda target)" in removed[0], removed
    assert f"({NEW} target)" in added[0] and f"+{PRELUDE_MARK}" in added and f"+{MARK}" in added, added


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_copy_runs_bitwise_like_cuda_emu(report, example):
    result = report["examples"][example]
    assert result["compared"], "nothing compared"
    assert not result["not_bitwise"], f"{DEVICE} differs from cuda-emu in {result['not_bitwise']}"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_copy_matches_the_interpreter(report, example):
    errors = report["examples"][example]["interp_error"]
    assert errors and max(errors.values()) < 1e-5, errors


# ---------------------------------------------------------------- run in a Python that imports the copy


def run_in_copy(root: str, out: str) -> None:
    """Compile and run the examples with the copied package (imported first from `root`), and write what was
    found to `out/report.json` (the test process checks it)."""
    import contextlib
    import io

    import cortexc
    from cortexc.cli import TARGET_CHOICES, main
    from cortexc.codegen.target import TARGETS
    from cortexc.errors import CortexcError
    from cortexc.frontend.parser import read_source
    from cortexc.options import CompileOptions
    from cortexc.pipeline import write_package
    from cortexc.runtime.backends import BACKENDS
    from cortexc.runtime.loader import import_package
    from cortexc.targets import NAMES
    from tests.helpers import random_inputs, relative_error, small_forest

    found: dict = {
        "root": root,
        "cortexc_file": cortexc.__file__,
        "names": list(NAMES),
        "target_name": TARGETS[NEW].name,
        "backends": {device: b.target for device, b in BACKENDS.items()},
        "examples": {},
    }
    runs: dict[str, dict] = {}
    for key, (file, dims) in EXAMPLES.items():
        path = REPO / "examples" / file
        options = CompileOptions.make(dims, targets=("cuda", NEW))
        module = import_package(write_package(read_source(path), str(path), Path(out) / "api", options))
        cls = getattr(module, module.__all__[0])
        rng = np.random.default_rng(33)
        models = {device: cls(device=device, seed=3) for device in (DEVICE, "cuda-emu", "interp")}
        initial = models["interp"].params
        params = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in initial.items()}
        forest = small_forest(models["interp"].cell, rng, 6, 12)
        inputs = random_inputs(models["interp"].cell, forest, rng)
        results = {}
        for device, model in models.items():
            model.load_params(params)
            forward = model(forest, grad=True, **inputs)
            upstream = {
                k: np.random.default_rng(5).standard_normal(v.shape).astype(np.float32) for k, v in forward.items()
            }
            grads = model.backward(forward, upstream)
            results[device] = {
                **{f"forward {k}": np.asarray(v) for k, v in forward.items()},
                **{f"d{k}": v for k, v in grads.items()},
            }
        runs[key] = {"forest": forest, "inputs": inputs, "params": params, "results": results[DEVICE]}
        spec = cls._spec
        sources = {t: (Path(cls._package) / spec.target(t).kernel_file).read_text() for t in ("cuda", NEW)}
        diff = difflib.unified_diff(sources["cuda"].splitlines(), sources[NEW].splitlines(), lineterm="", n=0)
        mine, theirs, reference = results[DEVICE], results["cuda-emu"], results["interp"]
        found["examples"][key] = {
            "kernel_files": {t: spec.target(t).kernel_file for t in ("cuda", NEW)},
            "source_diff": [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")],
            "compared": sorted(mine),
            "not_bitwise": sorted(
                k
                for k in mine.keys() | theirs.keys()
                if k not in mine or k not in theirs or not np.array_equal(mine[k], theirs[k])
            ),
            "interp_error": {k: relative_error(mine[k], reference[k]) for k in mine},
        }

    # the CLI: `cortexc compile --target cudacopy-emu` makes a package of the new target's kernels alone
    path, dims = REPO / "examples" / EXAMPLES["treelstm"][0], EXAMPLES["treelstm"][1]
    argv = ["compile", str(path), "--target", DEVICE, "-o", str(Path(out) / "cli")]
    argv += [arg for name, value in dims.items() for arg in ("-D", f"{name}={value}")]
    with contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    package = Path(out) / "cli" / "treelstm"
    description = json.loads((package / "cell.json").read_text())
    cls = import_package(package).ChildSumTreeLSTM
    run = runs["treelstm"]
    model = cls(device=DEVICE, seed=3)
    model.load_params(run["params"])
    forward = model(run["forest"], grad=True, **run["inputs"])
    same = all(np.array_equal(forward[k], run["results"][f"forward {k}"]) for k in forward)
    c_only = write_package(read_source(path), str(path), Path(out) / "c", CompileOptions.make(dims, targets=("c",)))
    errors = {}
    for name, without, device in (
        ("without_c", cls, "cpu"),
        ("without_new", import_package(c_only).ChildSumTreeLSTM, DEVICE),
    ):
        try:
            without(device=device)
            errors[name] = ""
        except CortexcError as err:
            errors[name] = str(err)
    found["cli"] = {
        "choices": {name: list(targets) for name, targets in TARGET_CHOICES.items()},
        "status": status,
        "package_targets": description["targets"],
        "kernel_files": sorted(p.name for p in package.iterdir() if p.suffix in (".c", ".cu")),
        "same_as_api": same,
        **errors,
    }
    (Path(out) / "report.json").write_text(json.dumps(found, indent=1))
