"""pip installs all of cortexc: every module and data file under `cortexc/` (grammar, templates, headers) is in
the wheel, and so is a target folder a newcomer adds (`cortexc/targets/<name>/`, found without editing
pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO


def _files(root, under):
    return {
        path.relative_to(root).as_posix()
        for path in (root / under).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def test_the_wheel_holds_every_file_of_the_package_and_of_a_new_target(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "cortexc", source / "cortexc", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(source / "cortexc" / "targets" / "cuda", source / "cortexc" / "targets" / "newtarget")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "w", source],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "w").glob("cortexc-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = {name for name in archive.namelist() if name.startswith("cortexc/")}
    expected = _files(source, "cortexc")
    assert {f for f in expected if f.startswith("cortexc/targets/newtarget/templates/")}, "the copy has templates"
    assert expected - packaged == set()
    assert {name for name in packaged if "__pycache__" in name} == set()
