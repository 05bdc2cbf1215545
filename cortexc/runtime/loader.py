"""`cortexc.load`: compile a `.cell` file in process and import the generated package."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from cortexc.runtime.build import cache_dir


def import_package(package_dir: Path) -> ModuleType:
    """Import a generated package from its directory under a name unique to its contents."""
    init = package_dir / "__init__.py"
    digest = hashlib.sha256((package_dir / "cell.json").read_bytes() + init.read_bytes()).hexdigest()[:12]
    module_name = f"{package_dir.name}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, init, submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_cell_file(path: str | os.PathLike, out_dir: str | os.PathLike | None, dims: Mapping[str, int]) -> ModuleType:
    from cortexc.codegen.module import write_package

    source = Path(path).read_text(encoding="utf-8")
    if out_dir is None:
        key = hashlib.sha256(json.dumps([source, str(path), sorted(dims.items())]).encode()).hexdigest()[:16]
        out_dir = cache_dir() / "packages" / key
    package_dir = write_package(source, str(path), out_dir, dict(dims), targets=("c", "cuda"))
    return import_package(package_dir)
