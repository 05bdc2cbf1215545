"""Import a generated package from its directory: it needs no compiler (a package carries everything the
runtime reads). Compiling a `.cell` file first is the pipeline's `load_file` (`cortexc.load`)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

from cortexc.errors import OutputError

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
