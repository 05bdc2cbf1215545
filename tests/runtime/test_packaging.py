"""The package list of pyproject.toml covers every data file cortexc reads (pip then installs it all, with no
setuptools warning about a data folder missing from `packages`)."""

from __future__ import annotations

import fnmatch

import pytest

from tests.helpers import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_every_data_file_is_in_a_listed_package_and_its_globs():
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packages, data, where = config["packages"], config["package-data"], config.get("package-dir", {})
    folders = {name: REPO / where.get(name, name.replace(".", "/")) for name in packages}
    for root in (REPO / "cortexc", REPO / "grammars"):
        for path in root.rglob("*"):
            if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            owner = next((name for name, folder in folders.items() if folder == path.parent), None)
            assert owner is not None, f"{path.relative_to(REPO)}: its folder is not a package in pyproject.toml"
            assert any(fnmatch.fnmatch(path.name, glob) for glob in data.get(owner, [])), (
                f"{path.relative_to(REPO)}: not matched by the package-data of {owner}"
            )
