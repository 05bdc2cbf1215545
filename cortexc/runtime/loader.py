"""`cortexc.load`: compile a `.cell` file in process and import the generated package.

`import_package` needs no compiler (a package carries everything the runtime
reads); `load_cell_file` compiles first, so it imports the pipeline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from cortexc.errors import OutputError
from cortexc.runtime.build import cache_dir

#: held while a package module runs: it is in `sys.modules` before it has run (its relative imports need
#: that), and another thread must not take it from there half-made. Reentrant: a package may load another.
_IMPORT_LOCK = threading.RLock()


def import_package(package_dir: Path) -> ModuleType:
    """Import a generated package from its directory under a name unique to its contents (thread-safe)."""
    init = package_dir / "__init__.py"
    try:
        digest = hashlib.sha256((package_dir / "cell.json").read_bytes() + init.read_bytes()).hexdigest()[:12]
    except OSError as err:
        raise OutputError(f"the package {package_dir} is damaged: {err.strerror or err}: {err.filename}") from None
    module_name = f"{package_dir.name}_{digest}"
    with _IMPORT_LOCK:
        return _import(module_name, package_dir, init)


def _import(module_name: str, package_dir: Path, init: Path) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, init, submodule_search_locations=[str(package_dir)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the package at {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[module_name]
        raise OutputError(f"the package {package_dir} is damaged: {init}: {err.msg}: compile it again") from None
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_cell_file(
    path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None, dims: Mapping[str, int]
) -> ModuleType:
    """Compile `path` (every target a backend of this machine may run) and import its package; the
    package goes to `out_dir`, or to the cache under the key of the source and options."""
    from cortexc.frontend.parser import read_source
    from cortexc.options import KNOWN_TARGETS, CompileOptions
    from cortexc.pipeline import write_package

    source = read_source(path)
    options = CompileOptions.make(dims, targets=KNOWN_TARGETS)
    if out_dir is None:
        out_dir = cache_dir() / "packages" / options.key(source, str(path))[:16]
    return import_package(write_package(source, str(path), out_dir, options))
